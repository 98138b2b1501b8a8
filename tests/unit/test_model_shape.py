"""model_shape: a meta-device build measured the same as a real one, fast even at 5B parameters."""

import time
from pathlib import Path

import pytest
from torch import nn

from batchpilot.config import load_config
from batchpilot.errors import BatchpilotError
from batchpilot.models.factory import build_model
from batchpilot.models.llama import Llama
from batchpilot.planning.model_shape import ModelShape
from batchpilot.train.shape import model_shape

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPT = "batchpilot.models.gpt:build"
LLAMA = "batchpilot.models.llama:build"


def measured(model: nn.Module) -> ModelShape:
    """The shape read off a real CPU build, the slow obvious way."""
    embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    llama = isinstance(model, Llama)  # RMSNorm, SwiGLU, separate Q K V; the GPT: LayerNorm, GELU, fused QKV
    heads = model.config.n_head
    kv_heads = model.config.n_kv_head if llama else heads
    return ModelShape(
        num_params=sum(p.numel() for p in model.parameters()),
        num_layers=len(model.blocks),
        hidden_size=embedding.embedding_dim,
        vocab_size=embedding.num_embeddings,
        ffn_hidden_size=getattr(model, "ffn_hidden_size", 4 * embedding.embedding_dim),
        largest_block_params=max(sum(p.numel() for p in block.parameters()) for block in model.blocks),
        kv_hidden_size=embedding.embedding_dim // heads * kv_heads,
        num_heads=heads,
        gated_mlp=llama,
        rms_norm=llama,
        input_projections=5 if llama else 2,
        context_length=model.config.max_seq_len if llama else model.config.block_size,
        # lookups: the GPT's position embedding (its wte is the tied head); a Llama's untied token embedding
        lookup_params=(0 if model.config.tie_embeddings else embedding.weight.numel())
        if llama
        else model.wpe.weight.numel(),
        tensor_parallel=True,  # the trainer has plans for both (train/tensor_parallel.py)
        # what the plans leave whole: the Llama's two norm scales a block and the final one; the GPT's LayerNorms,
        # fused QKV and row-parallel biases a block, its position embedding and final LayerNorm
        whole_block_params=sum(
            p.numel()
            for name, p in model.blocks[0].named_parameters()
            if (name.endswith("norm.weight") if llama else name.startswith(("ln_", "attn.qkv.")))
            or name in ("attn.proj.bias", "mlp.2.bias")
        ),
        whole_outer_params=sum(
            p.numel()
            for name, p in model.named_parameters()
            if name in (("norm.weight",) if llama else ("wpe.weight", "ln_f.weight", "ln_f.bias"))
        ),
    )


@pytest.mark.parametrize(
    ("factory", "args"),
    [
        (GPT, {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 100}),
        (LLAMA, {"n_layer": 3, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "vocab_size": 100}),
        (LLAMA, {"n_layer": 2, "n_embd": 64, "ffn_hidden_size": 96, "tie_embeddings": True}),
    ],
)
def test_the_meta_shape_equals_a_real_builds(factory, args):
    assert model_shape(factory=factory, args=args) == measured(build_model(factory=factory, args=args))


def test_gpt_shape_counts_its_tied_head_once_and_its_mlp_as_4x():
    shape = model_shape(factory=GPT, args={"n_layer": 2, "n_embd": 64, "block_size": 16, "vocab_size": 100})
    model = build_model(factory=GPT, args={"n_layer": 2, "n_embd": 64, "block_size": 16, "vocab_size": 100})
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert shape.num_params == with_duplicates - 100 * 64
    assert shape.ffn_hidden_size == 4 * 64
    # wte 100 x 64 + wpe 16 x 64 + 2 blocks + final LayerNorm (weight and bias).
    assert shape.num_params == 100 * 64 + 16 * 64 + 2 * shape.largest_block_params + 2 * 64


def test_the_5b_example_config_is_measured_on_meta_in_well_under_2_s():
    config = load_config(CONFIGS / "llama_5b.yaml")
    started = time.perf_counter()
    shape = model_shape(factory=config.model.factory, args=config.model.args)
    elapsed_s = time.perf_counter() - started
    # The count in the config's header comment.
    assert shape == ModelShape(
        num_params=5_016_124_416,
        num_layers=42,
        hidden_size=3072,
        vocab_size=128256,
        ffn_hidden_size=8192,
        largest_block_params=100_669_440,
        kv_hidden_size=1024,
        num_heads=24,
        gated_mlp=True,
        rms_norm=True,
        input_projections=5,
        context_length=4096,
        lookup_params=128256 * 3072,  # the untied token embedding
        tensor_parallel=True,
        whole_block_params=2 * 3072,  # the two RMSNorm scales
        whole_outer_params=3072,  # the final norm's
    )
    assert elapsed_s < 1.0


def test_a_model_without_blocks_has_no_layers():
    shape = model_shape(factory="torch.nn:Embedding", args={"num_embeddings": 10, "embedding_dim": 4})
    assert shape == ModelShape(
        num_params=40,
        num_layers=0,
        hidden_size=4,
        vocab_size=10,
        ffn_hidden_size=16,
        largest_block_params=0,
        lookup_params=40,
    )


def test_a_model_without_an_embedding_names_model_factory():
    with pytest.raises(
        BatchpilotError, match=r"^model.factory: torch.nn:Linear built a Linear with no nn.Embedding"
    ):
        model_shape(factory="torch.nn:Linear", args={"in_features": 4, "out_features": 4})


def test_factory_errors_pass_through():
    with pytest.raises(BatchpilotError, match=r"^model.args: batchpilot.models.llama:build rejected"):
        model_shape(factory=LLAMA, args={"n_head": 4, "n_kv_head": 3})
