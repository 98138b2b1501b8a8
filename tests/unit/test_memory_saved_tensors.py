"""The activation estimate (planning/memory.py) against what PyTorch really keeps, measured on CPU.

A block's activations are the tensors autograd saves in its forward for its backward: summed here with
`torch.autograd.graph.saved_tensors_hooks` (each storage once; parameters, buffers and autocast's weight
copies left out, which the estimate counts as model state and working set). The loss's figure is a peak,
not a saved set: the bytes of live tensors, followed op by op with a dispatch mode, through the trainer's
own loss function's forward and backward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchpilot.models.gpt import GPT, GPTConfig
from batchpilot.models.llama import Llama, LlamaConfig
from batchpilot.planning.activations import LOSS_BYTES_PER_LOGIT, block_activation_bytes_per_token
from batchpilot.train.shape import model_shape
from batchpilot.train.step import micro_batch_loss

# 96 tokens: no parameter has a dimension of 96, so no activation is mistaken for a weight copy.
BATCH, SEQ = 2, 48
LLAMA_ARGS = {"n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "max_seq_len": SEQ, "vocab_size": 512}
GPT_ARGS = {"n_layer": 1, "n_head": 4, "n_embd": 128, "block_size": SEQ, "vocab_size": 512}


def saved_bytes(model: nn.Module, run: Any) -> int:
    """Bytes of the distinct storages autograd saves while `run()` runs, less the model's own tensors."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {
        tuple(p.shape)[::-1] for p in model.parameters()
    }
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own and tuple(tensor.shape) not in weight_shapes:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved.values())


def one_block(factory: str) -> tuple[nn.Module, Any, Any]:
    """(model, its first block's forward on a random residual stream, the model's shape)."""
    torch.manual_seed(0)
    if factory == "llama":
        args, model = LLAMA_ARGS, Llama(LlamaConfig(**LLAMA_ARGS))
        extra: tuple[torch.Tensor, ...] = (model.rope_cos[:SEQ], model.rope_sin[:SEQ])
        shape = model_shape(factory="batchpilot.models.llama:build", args=args)
    else:
        args, model = GPT_ARGS, GPT(GPTConfig(**GPT_ARGS))
        extra = ()
        shape = model_shape(factory="batchpilot.models.gpt:build", args=args)
    x = torch.randn(BATCH, SEQ, shape.hidden_size, requires_grad=True)
    return model, lambda: model.blocks[0](x, *extra), shape


@pytest.mark.parametrize("factory", ["llama", "gpt"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_blocks_saved_activations_are_the_estimate_within_10_percent(factory, mixed):
    model, forward, shape = one_block(factory)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    with autocast:
        measured = saved_bytes(model, forward)
    # Under autocast the residual stream and the norms stay fp32; the matmuls' tensors are bf16.
    per_token = block_activation_bytes_per_token(
        shape, act_bytes=2 if mixed else 4, residual_bytes=4, autocast=mixed
    )
    estimated = per_token * BATCH * SEQ
    assert abs(estimated - measured) <= 0.1 * measured, (factory, mixed, estimated, measured)


def test_swiglu_and_grouped_query_attention_are_what_the_llama_block_saves():
    # The Llama's four f-wide tensors (gate, up, silu(gate), their product) and its narrower K and V: the
    # old GELU-shaped count (two f-wide, full-width K and V) misses the measurement by far more than 10%.
    model, forward, shape = one_block("llama")
    measured = saved_bytes(model, forward)
    as_gelu = block_activation_bytes_per_token(
        shape.__class__(**{**shape.__dict__, "gated_mlp": False}),
        act_bytes=4,
        residual_bytes=4,
        autocast=False,
    )
    assert shape.gated_mlp and shape.rms_norm and shape.kv_hidden_size == 64 and shape.num_heads == 4
    assert as_gelu * BATCH * SEQ < 0.8 * measured


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of live tensors created under it (each storage once, until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out


def test_the_live_bytes_tracker_sees_frees():
    with LiveBytes() as tracker:
        a = torch.ones(1000)
        del a
        b = torch.ones(1000)
        c = b * 2
    assert tracker.peak == 8000 and c.numel() == 1000


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_loss_peaks_at_12_bytes_per_logit(mixed):
    """The trainer's `micro_batch_loss` on a head alone (8 wide, so the logits dominate), forward and
    backward: the peak is the log-softmax's fp32 output plus two fp32 gradients, whatever the logits' dtype."""
    torch.manual_seed(0)
    vocab, width = 1000, 8
    head = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab, bias=False))
    batch = torch.randint(0, vocab, (BATCH, SEQ + 1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    with LiveBytes() as tracker:
        micro_batch_loss(head, batch, autocast).backward()
    logits = BATCH * SEQ * vocab
    assert abs(tracker.peak / logits - LOSS_BYTES_PER_LOGIT) <= 0.1 * LOSS_BYTES_PER_LOGIT, (
        tracker.peak / logits
    )


def test_autocast_copies_a_norms_output_once_per_projection_reading_it():
    # Llama's Q, K, V, gate and up projections each cast the fp32 norm output to bf16 (autocast caches the
    # casts of parameters only): 5 copies where FSDP's bf16 parameters keep one per norm.
    model, forward, shape = one_block("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_bytes(model, forward)

    def estimate(autocast: bool) -> int:
        per_token = block_activation_bytes_per_token(shape, act_bytes=2, residual_bytes=4, autocast=autocast)
        return per_token * BATCH * SEQ

    assert shape.input_projections == 5
    assert abs(estimate(True) - measured) <= 0.01 * measured
    assert estimate(False) < 0.95 * measured
