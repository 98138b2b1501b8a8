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

Only models with a plan here take tensor parallelism; the plan refuses the others before any launch
(`planning.memory.tensor_parallel_problem`, fed by `has_plan`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

from batchpilot.models.llama import Llama

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def has_plan(model: nn.Module) -> bool:
    """Whether `apply_tensor_parallel` knows how to split this model."""
    return isinstance(model, Llama)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Splits `model` (on meta, before `fully_shard`) over the 1-D tensor-parallel `mesh` (module docstring)."""
    # DTensor's parallel styles are imported here, not with the module: `plan` reads `has_plan` through
    # train/shape.py, and importing them costs about half a second there.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    assert has_plan(model), f"no tensor-parallel plan for {type(model).__name__} (refused at plan time)"
    assert isinstance(model, Llama)
    tied = model.output.weight is model.tok_embeddings.weight
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    if tied:  # each side was distributed on its own: one vocabulary-split parameter again
        model.output.weight = model.tok_embeddings.weight
    # The gathered logits are a view of the all-gather's buffer, which FSDP2 warns of in case the caller
    # changes them in place (its backward hook would be lost); the loss upcasts them out of place
    # (step.micro_batch_loss), so the warning (one per FSDP unit on every rank) says nothing here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
