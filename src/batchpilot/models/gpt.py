"""A small GPT (nanoGPT class): token + position embeddings, pre-norm blocks, tied output head.

`build(**args)` is the `model.factory` entry point: `batchpilot.models.gpt:build`. The model maps token
ids `[batch, seq]` to logits `[batch, seq, vocab]`; the trainer computes the loss, so any module with
that signature can be trained. Activation checkpointing is a switch on the model
(`set_activation_checkpointing`), separate from how the trainer parallelises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model.

    Attributes:
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: embedding width (a multiple of n_head).
        block_size: longest sequence the position embedding covers.
        vocab_size: token ids are in [0, vocab_size).
        dropout: dropout probability (0 keeps training deterministic).
        bias: biases in linear and norm layers.
    """

    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.args.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.args.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # Q, K and V side by side; `-1` heads: under tensor parallelism a device's QKV projection gives the
        # Q, K and V of its heads only (train/tensor_parallel.py), and its heads are -1 of `head_dim` each.
        q, k, v = self.qkv(x).chunk(3, dim=2)
        head_dim = width // self.n_head
        q, k, v = (t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx) -> logits`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.activation_checkpointing = False
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):  # scaled residual projections (GPT-2)
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in the backward pass instead of storing them."""
        self.activation_checkpointing = enabled

    def outer_modules(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The modules that run before the first block (token and position embeddings) and after the last
        (final norm, output head): the trainer shards each side as one unit, or both as one when they share
        a weight, as the tied head and token embedding do here (train/parallel.py)."""
        return [self.wte, self.wpe], [self.ln_f, self.head]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds model.args.block_size {self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def build(**args: object) -> GPT:
    """The `model.factory` entry point: `GPT(GPTConfig(**args))`."""
    unknown = sorted(set(args) - set(GPTConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"model.args: unknown key {unknown[0]!r} for batchpilot.models.gpt; "
            f"valid keys are: {', '.join(GPTConfig.__dataclass_fields__)}"
        )
    return GPT(GPTConfig(**args))  # type: ignore[arg-type]
