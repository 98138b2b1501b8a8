"""Tensor and sequence parallelism within a node (`train.tensor_parallel_size`), applied to a meta-device model
before FSDP2 shards it over the data-parallel dimension of the same mesh (parallel.py).

The Llama's plan is torchtitan's (Megatron-LM's column/row split with sequence parallelism):
- the token embedding is split over the vocabulary (row-parallel), its output scattered along the sequence;
- in each block the two norms run on each device's part of the sequence (`SequenceParallel`); the part is
  gathered whole before attention and the MLP (`PrepareModuleInput`), whose input projections are split by
  output (column-parallel: `wq`, `wk`, `wv` by heads, `w1`, `w3` by the MLP's width) and whose output
  projections by input (row-parallel: `wo`, `w2`), their sum reduce-scattered back along the sequence;
- the final norm is sequence-parallel and the output head column-parallel over the vocabulary, its logits
  gathered whole (every device of the group computes the same loss: no loss-parallel step).

So each device holds 1/t of every matrix, whole norms (their gradients summed over the group by DTensor),
and 1/t of the residual stream between blocks. The attention views its projections with `-1` heads, so a
device's heads are those of its part (models/llama.py). A tied embedding and head are both split over the
vocabulary (dimension 0 of the shared weight), so they stay one parameter.

The GPT's plan is the same shape (the embedding, the norms, the MLP and the head as the Llama's), with two
parts of its own:
- the position embedding stays whole on every device, and each device adds the rows of its part of the
  sequence (its gradient gathered whole from the parts, the same on every device);
- the fused QKV projection (`qkv`, rows Q then K then V) stays whole on every device, and each device
  multiplies only its heads' rows of each of the three (`_FusedColumnwise`: row views, no copy; the
  gradient of the rows it did not use is summed over the group). Splitting its rows over the devices,
  as column-parallel does, would give each device the rows of the wrong heads (its first third, Q of the
  first heads only); the strided split that does fit (`_StridedShard`) gave wrong full tensors under
  FSDP2 in torch 2.13 (seen on 4 gloo ranks), and regrouping the rows per head would change the
  checkpoints' layout and the demo's losses. So the QKV's parameters are whole per device, sharded by
  FSDP over the data-parallel ranks (the memory model counts them so: `ModelShape.replicated_params`).

Only models with a plan here take tensor parallelism; the plan refuses the others before any launch
(`planning.memory.tensor_parallel_problem`, fed by `has_plan`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from batchpilot.models.gpt import GPT
from batchpilot.models.llama import Llama

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def has_plan(model: nn.Module) -> bool:
    """Whether `apply_tensor_parallel` knows how to split this model."""
    return isinstance(model, (Llama, GPT))


def whole_params(model: nn.Module) -> tuple[int, int]:
    """Parameters the model's plan leaves whole on every device of a group: (of the first block, outside the
    blocks). Llama: the norms' scales. GPT: the LayerNorms (scale and bias), the fused QKV projection, the
    row-parallel projections' biases (added once, after their sum) and the position embedding."""
    assert has_plan(model), f"no tensor-parallel plan for {type(model).__name__}"

    def own(*modules: nn.Module) -> int:
        return sum(p.numel() for module in modules for p in module.parameters(recurse=False))

    blocks: Any = model.blocks  # a ModuleList of the model's own blocks
    if not len(blocks):
        return 0, own(model.wpe, model.ln_f) if isinstance(model, GPT) else own(cast(Llama, model).norm)
    if isinstance(model, GPT):
        block = blocks[0]
        row_biases = sum(m.bias.numel() for m in (block.attn.proj, block.mlp[2]) if m.bias is not None)
        return own(block.ln_1, block.ln_2, block.attn.qkv) + row_biases, own(model.wpe, model.ln_f)
    assert isinstance(model, Llama)
    first = blocks[0]
    return own(first.attention_norm, first.ffn_norm), own(model.norm)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Splits `model` (on meta, before `fully_shard`) over the 1-D tensor-parallel `mesh` (module docstring)."""
    # DTensor's parallel styles are imported in the functions below, not with the module: `plan` reads
    # `has_plan` through train/shape.py, and importing them costs about half a second there.
    assert has_plan(model), f"no tensor-parallel plan for {type(model).__name__} (refused at plan time)"
    if isinstance(model, GPT):
        _apply_to_gpt(model, mesh)
    else:
        assert isinstance(model, Llama)
        _apply_to_llama(model, mesh)
    # The gathered logits are a view of the all-gather's buffer, which FSDP2 warns of in case the caller
    # changes them in place (its backward hook would be lost); the loss upcasts them out of place
    # (step.micro_batch_loss), so the warning (one per FSDP unit on every rank) says nothing here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _apply_to_llama(model: Llama, mesh: DeviceMesh) -> None:
    _split(model, mesh, embedding="tok_embeddings", final_norm="norm", head="output", block_plan=_llama_block)


def _apply_to_gpt(model: GPT, mesh: DeviceMesh) -> None:
    _split(model, mesh, embedding="wte", final_norm="ln_f", head="head", block_plan=_gpt_block)
    _positions_of_each_part(model.wpe, mesh)
    blocks: Any = model.blocks
    for block in blocks:
        _fused_columnwise(block.attn.qkv, mesh, parts=3)


def _split(
    model: nn.Module, mesh: DeviceMesh, *, embedding: str, final_norm: str, head: str,
    block_plan: Callable[[], dict[str, Any]],
) -> None:  # fmt: skip
    """What the plans share: the token embedding split over the vocabulary (its output scattered along the
    sequence), the final norm sequence-parallel, the head column-parallel with the logits gathered whole, and
    each block split by `block_plan`; a tied embedding and head share one vocabulary-split parameter again."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tied = getattr(model, head).weight is getattr(model, embedding).weight
    parallelize_module(
        model,
        mesh,
        {
            embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            final_norm: SequenceParallel(),
            head: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    blocks: Any = model.blocks
    for block in blocks:
        parallelize_module(block, mesh, block_plan())
    if tied:  # each side was distributed on its own: one vocabulary-split parameter again
        getattr(model, head).weight = getattr(model, embedding).weight


def _llama_block() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def _gpt_block() -> dict[str, Any]:
    """The GPT's block but its fused QKV (`_fused_columnwise`, applied after)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _replicated(module: nn.Module, mesh: DeviceMesh) -> None:
    """The module's own parameters as DTensors whole on every device of `mesh`."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))


def _positions_forward(module: nn.Embedding, positions: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """The position embeddings of this device's part of the sequence (dimension 0 of the lookup)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole: Any = F.embedding(
        DTensor.from_local(positions, mesh, [Replicate()], run_check=False), module.weight
    )
    return whole.redistribute(placements=[Shard(0)]).to_local()


def _fused_columnwise_forward(module: nn.Linear, x: Any, *, parts: int, mesh: DeviceMesh) -> torch.Tensor:
    """This device's heads' rows of each of the `parts` projections, side by side (the module docstring)."""
    from torch.distributed.tensor import DTensor, Partial

    assert isinstance(x, DTensor), "the fused projection's input comes gathered whole (PrepareModuleInput)"
    # Each device's result depends on the input and the parameters through its own rows only: the gradients
    # the device sends back are its share of their sums over the group (Partial), which DTensor and FSDP2
    # reduce (FSDP2 redistributes a DTensor gradient to its parameter's placements before reducing it).
    inputs = x.to_local(grad_placements=[Partial()])
    if torch.is_autocast_enabled(inputs.device.type):  # one low-precision copy for the three projections
        inputs = inputs.to(torch.get_autocast_dtype(inputs.device.type))
    parameters: Any = module  # its weight and bias are DTensors (`_replicated`)
    weight = parameters.weight.to_local(grad_placements=[Partial()])
    bias = None if parameters.bias is None else parameters.bias.to_local(grad_placements=[Partial()])
    size, rank = mesh.size(), mesh.get_local_rank()
    rows = weight.shape[0] // (parts * size)
    outputs = []
    for part in range(parts):
        first = (part * size + rank) * rows
        part_bias = None if bias is None else bias[first : first + rows]
        outputs.append(F.linear(inputs, weight[first : first + rows], part_bias))
    return torch.cat(outputs, dim=-1)


def _positions_of_each_part(module: nn.Embedding, mesh: DeviceMesh) -> None:
    """The GPT's position embedding under sequence parallelism: whole on every device, each adding the rows
    of its part of the sequence (`_positions_forward`)."""
    _replicated(module, mesh)
    module.forward = functools.partial(_positions_forward, module, mesh=mesh)  # type: ignore[method-assign]


def _fused_columnwise(module: nn.Linear, mesh: DeviceMesh, *, parts: int) -> None:
    """Column-parallel for a projection whose output is `parts` projections side by side (the GPT's fused
    QKV): the parameters whole on every device, each device computing its heads' rows of each part."""
    _replicated(module, mesh)
    module.forward = functools.partial(  # type: ignore[method-assign]
        _fused_columnwise_forward, module, parts=parts, mesh=mesh
    )
