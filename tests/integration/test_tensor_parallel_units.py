"""Tensor parallelism's arithmetic on real gloo processes (one per rank, spawned here), a Llama and a GPT on 2
nodes x 2 ranks with each node's 2 ranks one tensor-parallel group (train/tensor_parallel.py):

- under fsdp (over the 2 groups) and hsdp (replicated across them), one step's accumulated gradient is the
  global batch's mean gradient computed in one process, and the clipped norm is its norm;
- the noise scale's small-batch term: under fsdp each data-parallel rank's own gradient of every pass (read
  from the reduce-scatter inputs of its tensor-parallel group, a norm's scale, whole on both ranks of a
  group, counted once); under hsdp, whose shard group is one data-parallel rank here, the first pass of a
  shard group; coherence compares the first two passes;
- each rank holds 1/2 of every matrix of a block and whole norms, and its heads are the whole model's heads
  of its part (the GPT: its fused QKV and position embedding whole, as many parameters per rank as the memory
  model counts);
- what a split block saves for its backward is the memory model's tensor-parallel estimate.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from test_sharding_units import (
    MICRO,
    _join,
    already_real,
    build,
    full,
    local_sq_norm,
    mean_loss_gradient,
    rank_micro_batches,
    spawn,
)
from torch.distributed.tensor import DTensor, Replicate

from batchpilot.train.parallel import wrap_model
from batchpilot.train.step import accumulate_gradients

pytestmark = pytest.mark.slow

TP = 2


def _tp_worker(
    rank: int, world_size: int, per_node: int, port: int, out: str, strategy: str, name: str
) -> None:
    ctx = _join(rank, world_size, per_node, port)
    model = build(name)
    parallel = wrap_model(
        model, ctx, strategy=strategy, bf16=False, materialize=already_real, tensor_parallel_size=TP
    )
    # Every rank of a tensor-parallel group trains its data-parallel rank's samples.
    outcome = accumulate_gradients(
        model=model,
        parallel=parallel,
        micro_batches=rank_micro_batches(rank // TP, world_size // TP),
        ctx=ctx,
        autocast=contextlib.nullcontext,
        measure_noise=True,
        measure_coherence=True,
    )
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    block = model.blocks[0]
    local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731
    result = {
        "grads": {name: full(p.grad) for name, p in model.named_parameters()},
        "norm": float(norm.full_tensor() if isinstance(norm, DTensor) else norm),
        "small_sq_norm": float(outcome.small_sq_norm),
        "small_batch": outcome.small_batch,
        "coherence": float(outcome.coherence) if outcome.coherence is not None else None,
        "describe": parallel.describe(),
        "wq_rows": local(block.attention.wq.weight if name == "llama" else block.attn.qkv.weight).shape[0],
        "norm_tp_replicated": isinstance(
            (block.attention_norm if name == "llama" else block.ln_1).weight.placements[-1], Replicate
        ),
        "local_params": sum(local(p).numel() for p in model.parameters()),
        "tp_placements": {
            name: (type(p.placements[-1]).__name__, getattr(p.placements[-1], "dim", None))
            for name, p in model.named_parameters()
            if isinstance(p, DTensor)
        },
    }
    torch.save(result, f"{out}.rank{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=["fsdp", "hsdp", "fsdp-gpt", "hsdp-gpt"])
def tp_ranks(request, tmp_path_factory) -> tuple[str, list[dict]]:
    """One step of 2 nodes x 2 ranks, tensor-parallel within each node, micro batch 2, accumulation 8; the
    Llama, or the GPT (`-gpt`). Returns the strategy (the Llama's) or `<strategy>-gpt`, and each rank's
    results."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    strategy, _, name = request.param.partition("-")
    out = tmp_path_factory.mktemp("tp") / "result"
    return request.param, spawn(_tp_worker, 4, 2, out, strategy, name or "llama")


def model_of(param: str) -> tuple[str, str]:
    """(strategy, model name) of a `tp_ranks` parameter."""
    strategy, _, name = param.partition("-")
    return strategy, name or "llama"


def test_the_accumulated_gradient_is_the_global_batch_mean(tp_ranks):
    param, ranks = tp_ranks
    strategy, model_name = model_of(param)
    whole_batch = torch.cat([batch for r in (0, 1) for batch in rank_micro_batches(r, 2)])
    reference = mean_loss_gradient(build(model_name), whole_batch)
    names = [name for name, _ in build(model_name).named_parameters()]
    whole_norm = float(torch.stack([g.double().norm() for g in reference]).norm())
    for result in ranks:
        assert (
            f"{strategy}: parameters sharded {2 if strategy == 'fsdp' else 1} ways, each block split 2 ways"
            in (result["describe"])
        )
        for name, expected in zip(names, reference, strict=True):
            assert torch.allclose(result["grads"][name], expected, rtol=1e-4, atol=1e-7), name
        assert result["norm"] == pytest.approx(whole_norm, rel=1e-5)


def test_noise_terms_count_a_norm_once_per_tensor_parallel_group(tp_ranks):
    """fsdp: the small batch is each data-parallel rank's micro batch (2 samples) in every pass, its squared
    norm the mean over its tensor-parallel group's processes (each holds its part times the group's size, so
    that the step's mean over every process is the data-parallel ranks' mean); hsdp: the first pass of the
    shard group's one data-parallel rank (2 samples), before the cross-node all-reduce. Coherence compares
    the first two passes of the shard group."""
    param, ranks = tp_ranks
    strategy, model_name = model_of(param)
    model = build(model_name)
    groups = [(0, 1)] if strategy == "fsdp" else [(0,), (1,)]  # data-parallel ranks per shard group
    for group in groups:
        first = torch.cat([rank_micro_batches(r, 2)[0] for r in group])
        second = torch.cat([rank_micro_batches(r, 2)[1] for r in group])
        g1, g2 = mean_loss_gradient(model, first), mean_loss_gradient(model, second)
        sq_norm = sum(float(g.double().pow(2).sum()) for g in g1)
        inner = sum(float((a.double() * b.double()).sum()) for a, b in zip(g1, g2, strict=True))
        cosine = inner / (sq_norm * sum(float(g.double().pow(2).sum()) for g in g2)) ** 0.5
        for dp_rank in group:
            tp_group = (TP * dp_rank, TP * dp_rank + 1)
            if strategy == "fsdp":
                expected = local_sq_norm(model, dp_rank, 2)
                read = sum(ranks[rank]["small_sq_norm"] for rank in tp_group) / TP
                assert read == pytest.approx(expected, rel=1e-5), dp_rank
            for rank in tp_group:
                result = ranks[rank]
                assert result["small_batch"] == MICRO * (1 if strategy == "fsdp" else len(group))
                if strategy == "hsdp":
                    assert result["small_sq_norm"] == pytest.approx(sq_norm, rel=1e-5), rank
                assert result["coherence"] == pytest.approx(cosine, rel=1e-5), rank


def test_each_rank_holds_half_of_each_matrix_and_whole_norms(tp_ranks):
    param, ranks = tp_ranks
    strategy, model_name = model_of(param)
    if model_name == "gpt":
        _gpt_rank_holds_its_part(strategy, ranks)
        return
    for result in ranks:
        # wq: 4 heads x 8 = 32 rows, split by heads over the group, then under fsdp over the 2 groups' shards
        assert result["wq_rows"] == (8 if strategy == "fsdp" else 16)
        assert result["norm_tp_replicated"]
        placements = result["tp_placements"]  # on the mesh's last dimension, tp
        assert placements["blocks.0.attention.wq.weight"] == ("Shard", 0)
        assert placements["blocks.0.attention.wo.weight"] == ("Shard", 1)
        assert placements["blocks.0.feed_forward.w2.weight"] == ("Shard", 1)
        assert placements["tok_embeddings.weight"] == ("Shard", 0)
        assert placements["output.weight"] == ("Shard", 0)
        assert placements["norm.weight"] == ("Replicate", None)


def _gpt_rank_holds_its_part(strategy: str, ranks: list[dict]) -> None:
    """The GPT: the fused QKV projection and the position embedding whole on each rank of a group, the other
    matrices split as the Llama's; per rank as many parameters as the memory model's tensor-parallel part."""
    from test_sharding_units import GPT_ARGS

    from batchpilot.train.shape import model_shape

    shape = model_shape(factory="batchpilot.models.gpt:build", args=GPT_ARGS)
    per_device = shape.tensor_parallel_part(TP).num_params
    for result in ranks:
        # qkv: 3 x 32 = 96 rows, whole on each rank of the group, under fsdp sharded over the 2 groups
        assert result["wq_rows"] == (48 if strategy == "fsdp" else 96)
        assert result["norm_tp_replicated"]
        placements = result["tp_placements"]
        assert placements["blocks.0.attn.qkv.weight"] == ("Replicate", None)
        assert placements["blocks.0.attn.qkv.bias"] == ("Replicate", None)
        assert placements["blocks.0.attn.proj.weight"] == ("Shard", 1)
        assert placements["blocks.0.attn.proj.bias"] == ("Replicate", None)
        assert placements["blocks.0.mlp.0.weight"] == ("Shard", 0)
        assert placements["blocks.0.mlp.2.weight"] == ("Shard", 1)
        assert placements["wte.weight"] == ("Shard", 0)
        assert placements["wpe.weight"] == ("Replicate", None)
        assert placements["ln_f.bias"] == ("Replicate", None)
        if strategy == "hsdp":  # a shard group is one node, its tensor-parallel group: no data-parallel split
            assert result["local_params"] == per_device
    assert per_device > shape.num_params / TP + 3 * 32 * 32  # the QKV whole: more than half per device


# tests/unit/test_memory_saved_tensors.py's block: 96 tokens, so no activation has a weight's shape.
BATCH, SEQ = 2, 48
SAVED_ARGS = {"n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "max_seq_len": SEQ, "vocab_size": 512}
SAVED_GPT_ARGS = {"n_layer": 1, "n_head": 4, "n_embd": 128, "block_size": SEQ, "vocab_size": 512}


def _saved_worker(
    rank: int, world_size: int, per_node: int, port: int, out: str, name: str = "llama"
) -> None:
    """What one Llama (or GPT) block saves for its backward on this rank of a tensor-parallel group of 2, from
    the residual stream's part of the sequence (as the blocks pass it under sequence parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh

    from batchpilot.models.factory import build_model
    from batchpilot.train.shape import model_shape
    from batchpilot.train.tensor_parallel import apply_tensor_parallel

    _join(rank, world_size, per_node, port)
    torch.manual_seed(0)
    factory, args = (
        ("batchpilot.models.llama:build", SAVED_ARGS) if name == "llama"
        else ("batchpilot.models.gpt:build", SAVED_GPT_ARGS)
    )  # fmt: skip
    model = build_model(factory=factory, args=args)
    shape = model_shape(factory=factory, args=args)
    apply_tensor_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    own = {local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    weight_shapes = {tuple(local(p).shape) for p in model.parameters()}
    weight_shapes |= {shape_[::-1] for shape_ in weight_shapes}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in own and tuple(local(tensor).shape) not in weight_shapes:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ // world_size, shape.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if name == "llama":
            model.blocks[0](x, model.rope_cos[:SEQ], model.rope_sin[:SEQ])
        else:
            model.blocks[0](x)
    torch.save({"saved_bytes": sum(saved.values()), "shape": shape}, f"{out}.rank{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_a_split_blocks_saved_activations_are_the_estimate_within_10_percent(tmp_path, monkeypatch, name):
    """The memory model's tensor-parallel activations (planning/memory.py, `tensor_parallel_size` 2) against
    what autograd saves on each rank of the group, as test_memory_saved_tensors measures one process."""
    from batchpilot.planning.activations import block_activation_bytes_per_token

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ranks = spawn(_saved_worker, 2, 2, tmp_path / "result", name)
    shape = ranks[0]["shape"]
    per_token = block_activation_bytes_per_token(
        shape, act_bytes=4, residual_bytes=4, autocast=False, tensor_parallel_size=2
    )
    estimated = per_token * BATCH * SEQ
    whole = (
        block_activation_bytes_per_token(shape, act_bytes=4, residual_bytes=4, autocast=False) * BATCH * SEQ
    )
    for rank in ranks:
        measured = rank["saved_bytes"]
        assert abs(estimated - measured) <= 0.1 * measured, (estimated, measured)
        assert measured < 0.7 * whole  # the split saves much less than one process does
