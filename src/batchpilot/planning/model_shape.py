"""The shape of a model as planning sees it: what the memory model and the FLOPs count need (no torch here;
train/shape.py reads it off a built model)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads (grouped-query attention has fewer than `num_heads`)."""
        if not self.num_heads or self.kv_hidden_size is None:
            return self.num_heads
        return self.kv_hidden_size * self.num_heads // self.hidden_size

    @property
    def replicated_params(self) -> int:
        """Parameters tensor parallelism leaves whole on every device of its group: the norms' scales (two per
        block and the final one), which sequence parallelism runs on each device's part of the sequence."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def matmul_params(self) -> int:
        """The parameters that multiply: the N of 6N (torchtitan's count leaves the embedding lookups out)."""
        return self.num_params - self.lookup_params
