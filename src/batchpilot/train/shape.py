"""The shape of the user's model (parameters, blocks, widths) read off a meta-device build.

The planner's memory and FLOPs models take a torch-free `ModelShape`; this is the one place that builds
the model to fill it in. Building under `torch.device("meta")` allocates no storage, so a 70B model is
measured in about the time its Python constructors take.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from batchpilot.errors import BatchpilotError
from batchpilot.models.factory import build_model
from batchpilot.planning.model_shape import ModelShape
from batchpilot.train.tensor_parallel import has_plan, whole_params


def model_shape(*, factory: str, args: dict[str, Any]) -> ModelShape:
    """Builds `factory(**args)` on the meta device and measures it.

    Args:
        factory: `model.factory`, `module:function`.
        args: `model.args`.

    Returns:
        Parameters counted once each (tied weights once), the blocks in `model.blocks` (0 when the model
        has no such nn.ModuleList), widths from the first nn.Embedding, and `model.ffn_hidden_size` when
        the model has that attribute, else 4 x hidden (the GPT's MLP); heads from `model.config`, the
        gated MLP and RMSNorm from the first block's modules.

    Raises:
        BatchpilotError: the factory fails (see `build_model`) or the model has no nn.Embedding.
    """
    with torch.device("meta"), _SkipMetaInPlace():
        model = build_model(factory=factory, args=args)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise BatchpilotError(
            "model.factory",
            f"{factory} built a {type(model).__name__} with no nn.Embedding, so its hidden and vocabulary "
            "sizes are unknown",
            "give the model a token embedding (nn.Embedding)",
        )
    blocks = getattr(model, "blocks", None)
    block_params = [_num_params(block) for block in blocks] if isinstance(blocks, nn.ModuleList) else []
    hidden_size = embedding.embedding_dim
    ffn_hidden_size = getattr(model, "ffn_hidden_size", None)
    ffn = int(ffn_hidden_size) if ffn_hidden_size is not None else 4 * hidden_size
    # What the activation estimate needs of a block: its heads (`model.config.n_head`, `n_kv_head`), whether
    # its MLP is gated (two projections up to the MLP's width) and its norms RMSNorm.
    config = getattr(model, "config", None)
    num_heads = int(getattr(config, "n_head", 0))
    num_kv_heads = int(getattr(config, "n_kv_head", num_heads))
    first = blocks[0] if isinstance(blocks, nn.ModuleList) and len(blocks) else nn.Module()
    linears = [m for m in first.modules() if isinstance(m, nn.Linear)]
    up = [m for m in linears if m.out_features == ffn]
    # Linear layers reading a norm's output: those taking the residual width in, less the attention's output
    # projection (which reads the attention's output).
    reading_norms = sum(m.in_features == hidden_size for m in linears) - 1
    return ModelShape(
        num_params=_num_params(model),
        num_layers=len(block_params),
        hidden_size=hidden_size,
        vocab_size=embedding.num_embeddings,
        ffn_hidden_size=ffn,
        largest_block_params=max(block_params, default=0),
        kv_hidden_size=hidden_size * num_kv_heads // num_heads if num_heads else None,
        num_heads=num_heads,
        gated_mlp=len(up) >= 2,
        rms_norm=any(isinstance(m, nn.RMSNorm) for m in first.modules()),
        input_projections=max(reading_norms, 2),
        context_length=_context_length(config),
        lookup_params=_lookup_params(model),
        tensor_parallel=has_plan(model),
        **(
            dict(zip(("whole_block_params", "whole_outer_params"), whole_params(model), strict=True))
            if has_plan(model)
            else {}
        ),
    )


CONTEXT_ATTRIBUTES = ("block_size", "max_seq_len", "max_position_embeddings")
"""Where a model's config says the longest sequence it takes (GPT, Llama, Hugging Face), first found wins."""


def _context_length(config: Any) -> int | None:
    for name in CONTEXT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class _SkipMetaInPlace(TorchFunctionMode):
    """Turns in-place value ops on meta tensors (the `nn.init` calls) into no-ops.

    Meta tensors hold no values, so nothing is lost; but several of these ops (`normal_`, `clamp_`,
    `erfinv_`) run through Python decompositions whose first use imports torch._dynamo, about 2 s.
    Ops that change a tensor's shape or strides still run.
    """

    _RESHAPING = frozenset(
        {
            "resize_",
            "resize_as_",
            "set_",
            "as_strided_",
            "squeeze_",
            "unsqueeze_",
            "t_",
            "transpose_",
            "swapdims_",
            "swapaxes_",
            "requires_grad_",
            "detach_",
        }
    )

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # Tensor methods pass the tensor first; `nn.init` functions pass it as `tensor=`.
        target = args[0] if args else kwargs.get("tensor")
        if (
            name.endswith("_")
            and not name.endswith("__")
            and name not in self._RESHAPING
            and isinstance(target, torch.Tensor)
            and target.is_meta
        ):
            return target
        return func(*args, **kwargs)


def _lookup_params(model: nn.Module) -> int:
    """Parameters of the nn.Embedding layers whose weight no nn.Linear shares (a tied one is the head's)."""
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in multiplied
    )


def _num_params(module: nn.Module) -> int:
    # `parameters()` yields a shared (tied) tensor once.
    return sum(param.numel() for param in module.parameters())
