"""Resolve `model.factory` (`module:function`) and build the user's torch.nn.Module."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from batchpilot.errors import BatchpilotError


def build_model(*, factory: str, args: dict[str, Any]) -> nn.Module:
    """Imports `factory` and calls it with `args`; every failure is one line naming model.factory/args."""
    module_name, _, attr = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise BatchpilotError(
            "model.factory", f"cannot import {module_name!r}: {error}", "check the module path and PYTHONPATH"
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise BatchpilotError("model.factory", f"{module_name!r} has no function {attr!r}")
    try:
        model = function(**args)
    except (TypeError, ValueError) as error:
        raise BatchpilotError("model.args", f"{factory} rejected its arguments: {error}") from None
    if not isinstance(model, nn.Module):
        raise BatchpilotError(
            "model.factory", f"{factory} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Switches activation checkpointing on a model that supports it; refuses otherwise."""
    switch = getattr(model, "set_activation_checkpointing", None)
    if switch is None:
        if enabled:
            raise BatchpilotError(
                "activation_checkpointing",
                f"{type(model).__name__} has no set_activation_checkpointing(enabled) method",
                "add one to your model or turn activation checkpointing off",
            )
        return
    switch(enabled)


def compile_model(model: nn.Module) -> int:
    """`train.compile`: torch.compile on each block of `model.blocks` (the repeated blocks share one compiled
    graph, and FSDP's per-block hooks stay outside the compiled code, as torchtitan does), else on the whole
    model. Returns how many blocks were compiled (0: the whole model)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
        for block in blocks:
            block.compile()
        return len(blocks)
    model.compile()
    return 0
