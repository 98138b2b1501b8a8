"""The model and optimizer state as checkpoints hold it: keyed by parameter name, whatever the strategy.

`torch.distributed.checkpoint.state_dict` gives the same names for a bare model, a DDP replica and FSDP
shards (DTensors), so a checkpoint written under one strategy and world size loads under another:
DCP reads, on every rank, the parts of each tensor that rank holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from batchpilot.train.checkpoint import Checkpoint, dcp_quietly, tensor_shapes, user_errors_of_dcp


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}` keyed by parameter name (this rank's shards under FSDP)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


_IMPLEMENTATION = ("fused", "foreach", "capturable")
"""Optimizer settings that belong to the hardware, not to the training state: a checkpoint written on GPUs
(fused AdamW) resumes on CPUs or TPUs with their own."""


@contextlib.contextmanager
def own_implementation(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around loading a checkpoint into `optimizer`: its groups keep this process's implementation settings
    (`_IMPLEMENTATION`) whatever the checkpoint's say."""
    kept = [{key: group.get(key) for key in _IMPLEMENTATION} for group in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        group.update(settings)


def restore_training_state(
    checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Loads the checkpoint into the (already wrapped or sharded) model and its optimizer, on every rank."""
    with own_implementation(optimizer):
        _restore(checkpoint, model, optimizer)


def _restore(checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if checkpoint.sharded:
        state = training_state(model, optimizer)  # the layout to read into: this rank's shards
        checkpoint.check_same_model(tensor_shapes(state["model"]))
        with user_errors_of_dcp(), dcp_quietly():
            dcp.load(state, storage_reader=checkpoint.reader(), no_dist=not dist.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return
    assert checkpoint.model is not None and checkpoint.optimizer is not None
    checkpoint.check_same_model(tensor_shapes(get_model_state_dict(model)))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=checkpoint.model,
        optim_state_dict=_named_optimizer_state(checkpoint.optimizer, model, optimizer),
        options=StateDictOptions(full_state_dict=True),
    )


def _named_optimizer_state(
    saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """A `full` checkpoint's optimizer state (`optimizer.state_dict()`: parameters numbered in the order of
    the optimizer's groups) keyed by parameter name instead, for `set_state_dict`."""
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    state = {ordered[int(index)]: value for index, value in saved["state"].items()}
    groups = []
    for group in saved["param_groups"]:
        groups.append({**group, "params": [ordered[int(index)] for index in group["params"]]})
    return {"state": state, "param_groups": groups}
