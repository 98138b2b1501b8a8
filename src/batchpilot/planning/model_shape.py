"""The shape of a model as planning sees it: what the memory model and the FLOPs count need (no torch here;
train/shape.py reads it off a built model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """What the memory model and the FLOPs count need to know of a model (no torch here).

    Attributes:
        num_params: trainable parameters (tied weights counted once).
        num_layers: transformer blocks (the units FSDP shards one at a time); 0 when the model has none.
        hidden_size: width of the residual stream (the token embedding's dimension).
        vocab_size: rows of the token embedding (the logits' width).
        ffn_hidden_size: width of the MLP's inner layer (4 x hidden for GPT, SwiGLU's intermediate size).
        largest_block_params: parameters of the largest block (0 when num_layers is 0).
        kv_hidden_size: width of the keys and of the values (None: hidden_size; less with grouped-query
            attention).
        num_heads: attention heads (the fused attention keeps one fp32 log-sum-exp per head and token).
        gated_mlp: the MLP is SwiGLU's (gate, up and down projections) rather than GELU's two.
        rms_norm: the norms are RMSNorm (which keeps its normalized output too), not LayerNorm.
        input_projections: linear layers reading a norm's output in a block (GPT: the fused QKV and the
            MLP's first, 2; Llama: Q, K, V, gate and up, 5); autocast saves a bf16 copy for each.
        context_length: the longest sequence the model takes (GPT's `block_size`, Llama's `max_seq_len`);
            None when the model does not say.
        lookup_params: parameters used by lookups, not matrix multiplies: the embeddings whose weight no
            linear layer shares (an untied token embedding, a position embedding).
        tensor_parallel: the trainer has a tensor-parallel plan for the model (train/tensor_parallel.py).
        whole_block_params: of a block's parameters, those its tensor-parallel plan leaves whole on every
            device of the group (None: its two norms' scales, as the Llama's; the GPT's plan also keeps its
            fused QKV projection, LayerNorm biases and its row-parallel projections' biases whole).
        whole_outer_params: the same outside the blocks (None: the final norm's scale; the GPT's adds its
            position embedding).
    """

    num_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    ffn_hidden_size: int
    largest_block_params: int
    kv_hidden_size: int | None = None
    num_heads: int = 0
    gated_mlp: bool = False
    rms_norm: bool = False
    input_projections: int = 2
    context_length: int | None = None
    lookup_params: int = 0
    tensor_parallel: bool = False
    whole_block_params: int | None = None
    whole_outer_params: int | None = None

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads (grouped-query attention has fewer than `num_heads`)."""
        if not self.num_heads or self.kv_hidden_size is None:
            return self.num_heads
        return self.kv_hidden_size * self.num_heads // self.hidden_size

    @property
    def replicated_params(self) -> int:
        """Parameters tensor parallelism leaves whole on every device of its group: by default the norms'
        scales (two per block and the final one), which sequence parallelism runs on each device's part of
        the sequence; `whole_block_params` and `whole_outer_params` where the model's plan says more."""
        return self.num_layers * self._whole_block + self._whole_outer

    @property
    def _whole_block(self) -> int:
        return 2 * self.hidden_size if self.whole_block_params is None else self.whole_block_params

    @property
    def _whole_outer(self) -> int:
        return self.hidden_size if self.whole_outer_params is None else self.whole_outer_params

    def tensor_parallel_part(self, size: int) -> ModelShape:
        """The part of the model one device of a tensor-parallel group of `size` holds, as FSDP2 gathers it:
        1/size of every split parameter (the vocabulary-split embedding too) and the whole ones whole."""
        if size == 1:
            return self
        block_whole = self._whole_block if self.num_layers else 0
        return replace(
            self,
            num_params=math.ceil((self.num_params - self.replicated_params) / size) + self.replicated_params,
            largest_block_params=math.ceil((self.largest_block_params - block_whole) / size) + block_whole,
            vocab_size=math.ceil(self.vocab_size / size),
        )

    @property
    def matmul_params(self) -> int:
        """The parameters that multiply: the N of 6N (torchtitan's count leaves the embedding lookups out)."""
        return self.num_params - self.lookup_params
