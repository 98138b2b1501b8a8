"""The shape of the Llama-style model (`LlamaConfig`), without torch: the plan-time checks read it too.

`batchpilot.models.llama` builds the model from it; `batchpilot.checks` compares it with a Hugging Face
checkpoint's config.json before any accelerator is requested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model.

    Attributes:
        n_layer: transformer blocks.
        n_head: query heads per block.
        n_kv_head: key/value heads per block (n_head a multiple of it; fewer is grouped-query attention).
        n_embd: residual stream width (a multiple of n_head with an even head size, for rotary pairs).
        max_seq_len: longest sequence the rotary tables cover.
        vocab_size: token ids are in [0, vocab_size).
        ffn_hidden_size: SwiGLU inner width; None: Llama's rule, 2/3 x 4 x n_embd rounded up to multiple_of.
        multiple_of: rounding of the default ffn_hidden_size.
        rope_theta: rotary base period (Llama 3: 500000).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the token embedding with the output head.
    """

    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    max_seq_len: int = 128
    vocab_size: int = 256
    ffn_hidden_size: int | None = None
    multiple_of: int = 256
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "max_seq_len", "vocab_size", "multiple_of"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.args.{name} must be positive, got {getattr(self, name)}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ValueError(f"model.args.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        for name in ("rope_theta", "norm_eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.args.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.args.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"model.args.n_embd / n_head ({self.n_embd // self.n_head}) must be even for rotary embeddings"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.args.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @property
    def resolved_ffn_hidden_size(self) -> int:
        """`ffn_hidden_size` if set, else Llama's rule: int(2/3 x 4 x n_embd) rounded up to multiple_of."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        width = int(2 * 4 * self.n_embd / 3)
        return self.multiple_of * math.ceil(width / self.multiple_of)
