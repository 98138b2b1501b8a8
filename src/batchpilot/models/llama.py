"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases.

`build(**args)` is the `model.factory` entry point: `batchpilot.models.llama:build`. Like the GPT, the model
maps token ids `[batch, seq]` to logits `[batch, seq, vocab]`, keeps its transformer blocks in
`model.blocks` (the units FSDP2 shards one at a time) and has an activation checkpointing switch.

Meta-device construction: the rotary cos/sin tables are non-persistent buffers (never checkpointed), so a
model built under `torch.device("meta")` and materialised with `model.to_empty(device=...)` holds garbage
there until `init_weights()` (parameters and buffers) or `reset_buffers()` (buffers only, e.g. before
loading a checkpoint) recomputes them. A model built on a real device needs neither call.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from batchpilot.models.llama_config import LlamaConfig

# `enable_gqa` came with torch 2.5; older releases get the kv heads repeated by hand.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def rope_tables(
    *, head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin, each `[max_seq_len, head_dim]` in fp32, for the rotate-half convention.

    `device=None` means the current default device (so `with torch.device("meta")` applies).
    """
    device = torch.empty(0, device=device).device
    if device.type == "meta":  # no values to compute (and meta arange takes a slow first-use path)
        empty = torch.empty(max_seq_len, head_dim, device=device, dtype=torch.float32)
        return empty, empty.clone()
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `x` `[batch, heads, seq, head_dim]` by position; computed in fp32, returned in x's dtype."""
    rotated = x.float() * cos + _rotate_half(x.float()) * sin
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # -1 heads: under tensor parallelism the projections give this device's heads only
        # (train/tensor_parallel.py), the same heads in the same order as the whole model's.
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        heads, kv_heads = q.shape[1], k.shape[1]
        if kv_heads == heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif _SDPA_HAS_GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            repeats = heads // kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.resolved_ffn_hidden_size
        self.w1 = nn.Linear(config.n_embd, hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.n_embd, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, config.n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer; `forward(idx) -> logits`.

    The rotary tables `rope_cos`/`rope_sin` live on the root (not in the blocks), so sharding the blocks
    leaves them alone; they stay fp32 under autocast, but `model.to(torch.bfloat16)` would round them.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(
            head_dim=config.head_dim, max_seq_len=config.max_seq_len, theta=config.rope_theta
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        self.init_weights()

    @property
    def ffn_hidden_size(self) -> int:
        """Width of the SwiGLU inner layer (what the memory and FLOPs models need)."""
        return self.config.resolved_ffn_hidden_size

    def reset_buffers(self) -> None:
        """Recomputes the rotary tables on the device they are on (after `to_empty`, they hold garbage)."""
        cos, sin = rope_tables(
            head_dim=self.config.head_dim,
            max_seq_len=self.config.max_seq_len,
            theta=self.config.rope_theta,
            device=self.rope_cos.device,
        )
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialises every parameter and buffer in place (works on FSDP2-sharded parameters too).

        Linear and embedding weights ~ N(0, 0.02); the residual output projections (`wo`, `w2`) get
        0.02 / sqrt(2 n_layer) so the residual stream's variance does not grow with depth (GPT-2).
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith((".wo", ".w2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        self.reset_buffers()

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in the backward pass instead of storing them."""
        self.activation_checkpointing = enabled

    def outer_modules(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The modules that run before the first block (the token embedding) and after the last (final
        norm, output head): the trainer shards each side as one unit, or both as one with
        `tie_embeddings` (train/parallel.py)."""
        return [self.tok_embeddings], [self.norm, self.output]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds model.args.max_seq_len {self.config.max_seq_len}"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.output(self.norm(x))


def build(**args: object) -> Llama:
    """The `model.factory` entry point: `Llama(LlamaConfig(**args))`."""
    unknown = sorted(set(args) - set(LlamaConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"model.args: unknown key {unknown[0]!r} for batchpilot.models.llama; "
            f"valid keys are: {', '.join(LlamaConfig.__dataclass_fields__)}"
        )
    return Llama(LlamaConfig(**args))  # type: ignore[arg-type]
