"""What a training step keeps for its backward, per token and per sample, in bytes.

Activations, with `activation_bytes_per_sample` (measured by explore, the slope of peak memory over the
micro batch): that times the micro batch ("explore"). Otherwise the tensors each block's forward saves for
its backward, per token (a = 2 bytes for a matmul's inputs and outputs in mixed precision, else 4; r = the
residual stream's bytes, fp32 under autocast and in fp32, bf16 under FSDP's bf16 parameters; h the width,
kv the keys' and values' width, f the MLP's inner width):
- each of the two norms: its input (r h) and fp32 statistics (LayerNorm mean and 1/std, 8 bytes; RMSNorm
  1/rms, 4 bytes), and RMSNorm's normalized input (r h) for its scale's gradient;
- attention: the norm's output that Q, K and V are projected from (a h; under autocast one bf16 copy per
  projection reading it, since autocast caches the casts of parameters only: 3 for separate Q, K and V,
  1 for a fused QKV), Q K V into the fused attention
  (a (h + 2 kv); with rotary positions the rotated Q and K), one fp32 log-sum-exp per head, the output
  projection's input (a h); no s x s term since `scaled_dot_product_attention` keeps no score matrix;
- MLP: the norm's output (a h; under autocast one copy per up projection: 2 for SwiGLU), then GELU's input
  and output (2 a f), or SwiGLU's gate and up projections,
  the gate's SiLU and the product (4 a f);
- no dropout masks: the built-in models train with dropout 0.
A test sums the bytes autograd saves for one Llama and one GPT block on CPU (saved_tensors_hooks) and
finds this within 10% (tests/unit/test_memory_saved_tensors.py). This is Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4.1) without its dropout masks
and with SwiGLU's four f-wide tensors. With activation checkpointing only each block's input is kept
(r h) plus one block's full activations while it is recomputed. On top: the final norm's saved tensors and
the head's input, and the loss: 12 bytes per logit (`LOSS_BYTES_PER_LOGIT`, measured: the log-softmax's
fp32 output and two fp32 gradients at the start of the backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from batchpilot.planning.model_shape import ModelShape

LOSS_BYTES_PER_LOGIT = 12
"""The cross-entropy's peak per logit, measured (tests/unit/test_memory_saved_tensors.py): the log-softmax's
saved fp32 output, the fp32 gradient arriving from the loss and the fp32 gradient it passes back, whether
the logits are bf16 or fp32 (the trainer upcasts them; the bf16 logits and their fp32 copy are freed
once the forward is done)."""


def block_activation_bytes_per_token(
    shape: ModelShape, *, act_bytes: int, residual_bytes: int, autocast: bool, tensor_parallel_size: int = 1
) -> float:
    """What one block's forward saves for its backward, per token (this module's docstring).

    Args:
        act_bytes: bytes of a matmul's inputs and outputs (2 in mixed precision, else 4).
        residual_bytes: bytes of the residual stream and the norms' saved tensors (fp32 under autocast).
        autocast: the norms' fp32 outputs are cast to bf16 once per projection reading them (autocast caches
            the casts of parameters only), not once per norm.
        tensor_parallel_size: devices splitting the block: the norms run on 1/t of the sequence (sequence
            parallel), the heads and the MLP's width are split t ways; the projections' inputs, gathered
            from the sequence's parts, are whole on every device (one tensor the column-parallel projections
            of a norm share).
    """
    h, f, t = shape.hidden_size, shape.ffn_hidden_size, tensor_parallel_size
    kv = shape.kv_hidden_size if shape.kv_hidden_size is not None else h
    norm_outputs = shape.input_projections if autocast else 2
    split = (
        2 * _norm_bytes_per_token(shape, residual_bytes=residual_bytes)
        + act_bytes * ((h + 2 * kv) + h)  # attention: Q K V, the output projection's input
        + 4 * shape.num_heads  # the fused attention's fp32 log-sum-exp
        + act_bytes
        * f
        * (4 if shape.gated_mlp else 2)  # SwiGLU: gate, up, silu(gate), product; GELU: in, out
    )
    whole = act_bytes * h * norm_outputs  # the inputs of the projections that read the norms
    return whole + split / t if t > 1 else whole + split


def _norm_bytes_per_token(shape: ModelShape, *, residual_bytes: int) -> int:
    """A norm's saved tensors per token: its input and fp32 statistics (LayerNorm: mean and 1/std), and
    RMSNorm's normalized input too (kept for the scale's gradient)."""
    h = shape.hidden_size
    if shape.rms_norm:
        return 2 * residual_bytes * h + 4
    return residual_bytes * h + 8


def activation_bytes_per_token(
    shape: ModelShape,
    *,
    mixed_precision: bool,
    activation_checkpointing: bool,
    residual_bytes: int,
    autocast: bool,
    tensor_parallel_size: int = 1,
) -> int:
    """Activation bytes per token of one sample, at the start of the backward (this module's docstring); under
    tensor parallelism the residual stream is split along the sequence, the logits gathered whole."""
    t = tensor_parallel_size
    act = 2 if mixed_precision else 4
    block = block_activation_bytes_per_token(
        shape, act_bytes=act, residual_bytes=residual_bytes, autocast=autocast, tensor_parallel_size=t
    )
    if activation_checkpointing:
        kept = shape.num_layers * residual_bytes * shape.hidden_size
        blocks = (kept / t if t > 1 else kept) + (block if shape.num_layers else 0)
    else:
        blocks = shape.num_layers * block
    norm = _norm_bytes_per_token(shape, residual_bytes=residual_bytes)
    head = (norm / t if t > 1 else norm) + act * shape.hidden_size
    return math.ceil(blocks + head + shape.vocab_size * LOSS_BYTES_PER_LOGIT)


def activation_bytes_per_sample(points: Sequence[tuple[int, int]]) -> float | None:
    """Bytes per extra sample: the least-squares slope of peak memory over the micro batch.

    Args:
        points: explore's (micro_batch_size, peak_memory_bytes) pairs, all measured with one setting.

    Returns:
        The slope, clamped at 0 (noise must not make activations negative); None with fewer than two
        distinct micro batch sizes.
    """
    if len({micro for micro, _ in points}) < 2:
        return None
    mean_x = sum(micro for micro, _ in points) / len(points)
    mean_y = sum(peak for _, peak in points) / len(points)
    covariance = sum((micro - mean_x) * (peak - mean_y) for micro, peak in points)
    variance = sum((micro - mean_x) ** 2 for micro, _ in points)
    return max(covariance / variance, 0.0)
