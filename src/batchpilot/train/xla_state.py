"""The XLA runtime's checkpoints, host agreement and input transfer.

Checkpoints: the eager trainer's sharded format (train/checkpoint.py), the state keyed by parameter name
as `state.training_state` gives it. torch_xla's SPMD planners let DCP see each sharded XLA tensor as its
shards: on saving, every host writes the shards its devices hold (replicated tensors once); on loading,
every host reads the parts of each tensor its devices hold, whatever device count wrote them (the
metadata records chunks by global offset, as for DTensors), so a checkpoint of 2 devices loads on 4, and
eager and XLA checkpoints load in either runtime.
"""

from __future__ import annotations

import resource
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict

from batchpilot.errors import BatchpilotError
from batchpilot.train.checkpoint import (
    Checkpoint,
    Checkpointer,
    dcp_quietly,
    tensor_shapes,
    user_errors_of_dcp,
)
from batchpilot.train.state import own_implementation, training_state
from batchpilot.train.xla import Layout, init_optimizer_state, shard_optimizer_state


def agree(*flags: bool) -> list[bool]:
    """For each flag, whether it is set on any host (an all-reduce over the hosts' CPU process group; free
    on one host)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(flags)
    tensor = torch.tensor([float(flag) for flag in flags])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(value) for value in tensor.tolist()]


def send_rows(rows: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This host's rows of one pass (its devices' micro-batches, in device order) as the pass's global
    batch on the XLA device, split along dim 0 over the mesh: device `d` holds rank d's samples. With
    `minibatch`, each host gives only its own rows and the global batch is the hosts' rows in order."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    spec = xs.ShardingSpec(layout.mesh, layout.batch_spec, minibatch=True)
    (batch,) = xm.send_cpu_data_to_device([rows], torch_xla.device(), spec)
    return batch


def peak_memory_bytes() -> int:
    """The device's peak bytes in use where the runtime reports it (TPU), else the host's peak RSS."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(torch_xla.device())
        peak = info.get("peak_bytes_used")
        if peak:
            return int(peak)
    except (RuntimeError, AttributeError, KeyError):  # CPU devices report no memory statistics
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def capture_xla_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """The RNG state with the XLA device's seed added (the eager trainer ignores the extra key)."""
    import torch_xla.core.xla_model as xm

    return {**rng, "xla": int(xm.get_rng_state())}


def start_xla_checkpoint(
    checkpointer: Checkpointer,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    consumed_samples: int,
    rng: dict[str, Any],
    extra: dict[str, Any],
    side_objects: dict[str, bytes] | None = None,
    last: bool = False,
) -> str:
    """Every host calls this: each takes its devices' shards to host memory (torch_xla's
    `_sharded_cpu_state_dict`, as its own asynchronous checkpoint manager does: each shard with its place in
    the global tensor) and, as the eager runtime's save (`Checkpointer.start_save_sharded`), copies them into
    the shared staging buffers, which is all training waits for (the staging copy is needed: without it, on PJRT's CPU
    client, the host shards changed with the next steps and a resume after kill -9 was not exact); the
    files are then written in the background by the host's writer process through torch_xla's SPMD planner,
    and host 0 commits. Returns the step folder's URI."""
    import torch_xla
    import torch_xla.experimental.distributed_checkpoint as xc
    from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

    torch_xla.sync()
    state, mappings = _flat_state(model, optimizer)
    return checkpointer.start_save_sharded(
        step=step,
        consumed_samples=consumed_samples,
        state=_sharded_cpu_state_dict(state),
        rng=capture_xla_rng(rng),
        extra=extra,
        planner=_save_planner(xc.SPMDSavePlanner, mappings),
        side_objects=side_objects,
        last=last,
    )


def restore_xla_state(
    checkpoint: Checkpoint, *, model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout
) -> None:
    """Loads a sharded checkpoint (written by either runtime, on any device count) into the sharded model
    and its optimizer, each host reading its devices' parts."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.experimental.distributed_checkpoint as xc

    if not checkpoint.sharded:
        raise BatchpilotError(
            "train.checkpoint_uri",
            f"step {checkpoint.step} is a `full` checkpoint (batchpilot before sharding), which runtime xla "
            "does not load",
            "resume it once with train.runtime: eager, whose next checkpoint is sharded",
        )
    checkpoint.check_same_model(tensor_shapes(model.state_dict()))  # global shapes, before any read
    init_optimizer_state(model, optimizer, layout)  # the tensors DCP loads into, already sharded
    torch_xla.sync()
    flat, mappings = _flat_state(model, optimizer)  # the layout to read into: this host's shards
    with user_errors_of_dcp(), dcp_quietly():
        dcp.load(
            flat,
            storage_reader=checkpoint.reader(),
            planner=xc.SPMDLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    state = unflatten_state_dict(flat, mappings)
    with own_implementation(optimizer):  # a GPU checkpoint's fused AdamW does not run on XLA
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    shard_optimizer_state(model, optimizer, layout)  # loading the optimizer made new tensors
    torch_xla.sync()
    if "xla" in checkpoint.rng:
        xm.set_rng_state(int(checkpoint.rng["xla"]))


def _flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], Any]:
    """The training state flattened as DCP's default planner (the eager trainer's) flattens it, and the
    paths back. torch_xla's planners flatten with an older rule (a list of dicts, AdamW's `param_groups`,
    stays one item); given the flat state they keep its keys, so both runtimes name every item alike."""
    return flatten_state_dict(training_state(model, optimizer))


def _save_planner(base: type, mappings: Any) -> Any:
    """torch_xla's SPMD save planner recording the default planner's paths (`mappings`), which a loader
    follows to put non-tensor values (the optimizer's settings) back where the eager trainer keeps them."""

    class SavePlanner(base):
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            self.mappings = mappings

    return SavePlanner()
