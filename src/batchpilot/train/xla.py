"""The XLA runtime's pieces (torch_xla, PJRT, SPMD): which runtime a config asks for, the host's place in
the slice, the device mesh, FSDP-style sharding, and checkpoints in the eager trainer's format.

One process per TPU host drives every chip of that host; with SPMD (`xr.use_spmd()`) the program is
written for one big device and the XLA compiler partitions it over all devices of the slice, inserting
the collectives. The data-parallel ranks of the eager trainer become devices: device `d` of the mesh
trains the samples rank `d` would train on a GPU job of the same world size (its rows of the batch).

Sharding follows torch_xla's FSDPv2 (`SpmdFullyShardedDataParallel`) without its wrapper, which renames
every parameter (`_orig_module.`) while checkpoints are keyed by the model's own parameter names (an XLA
checkpoint loads in the eager trainer and back):
- every parameter is sharded over the shard axis along its largest dimension, uneven sizes included (XLA
  pads the last shard), norms and biases too: no parameter is replicated on every device;
- each block's output is marked sharded along the batch (FSDPv2's `shard_output`), so the compiler keeps
  activations split by sample between blocks instead of choosing a layout of its own;
- each block's backward ends at an optimization barrier over its gradients and input gradients, so the
  compiler cannot fuse blocks' backward passes into one with gigantic gradient buffers;
- AdamW's moments exist, sharded as their parameters, before the first step: the first step compiles the
  same graph as every later one.
The compiler gathers each parameter where it is used, as FSDP's all-gather does, and reduce-scatters its
gradient into the same layout.

torch_xla is imported lazily (inside functions): the eager trainer, the planner and the tests of the
main venv never import it. Install it with the `tpu` extra (a torch/torch_xla pair pinned together).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.models.deferred import reset_buffers
from batchpilot.train.accelerators import require_tpu
from batchpilot.train.parallel import model_blocks

XLA_RUNTIME = "xla"


def import_torch_xla() -> Any:
    """torch_xla, or a one-line error saying how to install it."""
    try:
        import torch_xla  # noqa: F401
        import torch_xla.runtime as xr
    except ImportError as error:
        raise BatchpilotError(
            "train.runtime",
            f"is xla but torch_xla cannot be imported ({error})",
            "install the `tpu` extra (pip install 'batchpilot[train,data,gcs,tpu]', torch and torch-xla 2.9.0 "
            "pinned together; scripts/setup_xla.sh builds .venv-xla), or set train.runtime: eager",
        ) from None
    return xr


def refuse_unsupported(config: Config) -> None:
    """Settings the XLA runtime does not implement: refused with one line each, never ignored."""
    if config.data.expansion_factor_real_data > 1:
        raise BatchpilotError(
            "data.expansion_factor_real_data",
            f"is {config.data.expansion_factor_real_data:g}: loading hosts are not implemented for runtime xla "
            "(every host reads its own devices' samples)",
            "set data.expansion_factor_real_data: 1, or train.runtime: eager",
        )
    if config.train.compile:
        raise BatchpilotError(
            "train.compile",
            "is not implemented for runtime xla (XLA compiles every step's graph itself)",
            "set train.compile: false",
        )


@dataclass(frozen=True)
class XlaHost:
    """This process in the slice: one process per host, each driving its host's devices.

    Attributes:
        host: this host's index (`TPU_WORKER_ID` on GKE TPU nodes, else `RANK`, else 0).
        num_hosts: processes of the job (the entries of `TPU_WORKER_HOSTNAMES`, else `WORLD_SIZE`, else 1).
        num_devices: devices of the whole slice (`xr.global_runtime_device_count()`): the data-parallel
            world size, one logical rank per device.
        num_local_devices: devices this host drives.
    """

    host: int
    num_hosts: int
    num_devices: int
    num_local_devices: int

    @property
    def is_main(self) -> bool:
        return self.host == 0


def host_from_env() -> tuple[int, int]:
    """(host index, number of hosts) from GKE's TPU environment, or torchrun's, or a lone process."""
    hostnames = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "TPU_WORKER_ID" in os.environ and hostnames:
        return int(os.environ["TPU_WORKER_ID"]), len([h for h in hostnames.split(",") if h.strip()])
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def start_runtime() -> XlaHost:
    """Turns SPMD on (before any XLA tensor exists), refuses `PJRT_DEVICE=TPU` on a host without TPUs
    (`require_tpu`) and, on several hosts, joins the CPU (gloo) process group that DCP needs to agree on a
    checkpoint across hosts (torch_xla's `xla://` rendezvous)."""
    xr = import_torch_xla()
    import torch.distributed as dist

    host, num_hosts = host_from_env()
    xr.use_spmd()
    require_tpu(xr)  # PJRT_DEVICE=TPU (the TPU JobSet) on a host without TPUs: one line, not a long trace
    if (xr.process_index(), xr.process_count()) != (host, num_hosts):
        raise BatchpilotError(
            "TPU_WORKER_ID",
            f"this process is host {host} of {num_hosts} by its environment but PJRT sees process "
            f"{xr.process_index()} of {xr.process_count()}",
            "run one trainer process per TPU host, with GKE's TPU_WORKER_ID and TPU_WORKER_HOSTNAMES",
        )
    if num_hosts > 1 and not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401  # registers the xla:// init method

        dist.init_process_group("gloo", init_method="xla://")
    return XlaHost(
        host=host,
        num_hosts=num_hosts,
        num_devices=int(xr.global_runtime_device_count()),
        num_local_devices=int(xr.addressable_runtime_device_count()),
    )


def uses_bf16_on_xla(precision: str) -> bool:
    """`train.precision`: auto is bf16 on TPUs and fp32 elsewhere (XLA on CPU, the local tests)."""
    import torch_xla.runtime as xr

    return precision == "bf16" or (precision == "auto" and xr.device_type() == "TPU")


def xla_device() -> torch.device:
    import torch_xla

    return torch_xla.device()


def place_streamed(
    model: nn.Module, layout: Layout, produce: Callable[[Callable[[str, torch.Tensor], None]], Any]
) -> int:
    """The meta-device `model`'s parameters made on the XLA devices one whole tensor at a time: `produce(deliver)`
    hands each to `deliver(name, cpu_tensor)` (the seed's recorded initialisation, `Deferred.stream`, the
    eager runtime's values bit for bit; or train.init_from's weights, `init_from.start_from` with `deliver`); each is
    uploaded, marked sharded (`_param_spec`) and dropped from the host before the next comes, so a host holds
    one tensor of the model, not all of it. Buffers are computed on the CPU, as the eager runtime computes
    them, and moved. Tied parameters stay one. Returns how many parameters are sharded.
    """
    import torch_xla.distributed.spmd as xs

    device = xla_device()
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    aliases = {name: group for group in names.values() for name in group}
    sharded = 0

    def deliver(name: str, values: torch.Tensor) -> None:
        nonlocal sharded
        if name not in aliases:  # a buffer: recomputed below
            return
        param = nn.Parameter(values.to(device), requires_grad=model.get_parameter(name).requires_grad)
        spec = _param_spec(param, layout)
        if spec is not None:
            xs.mark_sharding(param, layout.mesh, spec)
            sharded += 1
        for alias in aliases[name]:
            owner, _, attribute = alias.rpartition(".")
            setattr(model.get_submodule(owner), attribute, param)

    produce(deliver)
    left = [name for name, param in model.named_parameters() if param.is_meta]
    assert not left, f"never delivered: {left}"  # build_deferred refuses a parameter nothing initialises
    place_buffers(model)
    return sharded


def place_buffers(model: nn.Module) -> None:
    """The model's buffers computed on the CPU (`reset_buffers`: the values the eager runtime computes, bit for
    bit), then moved to the XLA device; wherever they were (meta, or device memory with no values)."""
    device = xla_device()
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype)
    reset_buffers(model)
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)


@dataclass(frozen=True)
class Layout:
    """The SPMD mesh and the partition specs of the batch and of sharded parameters.

    fsdp: a 1-D mesh `("fsdp",)` of all devices, parameters and batch over it. hsdp: `("dp_replicate",
    "dp_shard")` = (nodes, devices per node): parameters sharded within a node, the batch over both axes.
    ddp: the 1-D mesh, parameters replicated.
    """

    mesh: Any
    batch_spec: tuple[Any, ...]
    param_axis: str | None
    shard_degree: int


def make_layout(*, strategy: str, num_devices: int, devices_per_node: int) -> Layout:
    import numpy as np
    import torch_xla.distributed.spmd as xs

    ids = np.arange(num_devices)
    if strategy == "hsdp" and num_devices % devices_per_node == 0 and num_devices > devices_per_node:
        shape = (num_devices // devices_per_node, devices_per_node)
        mesh = xs.Mesh(ids, shape, ("dp_replicate", "dp_shard"))
        return Layout(mesh, (("dp_replicate", "dp_shard"), None), "dp_shard", devices_per_node)
    mesh = xs.Mesh(ids, (num_devices,), ("fsdp",))
    if strategy == "ddp":
        return Layout(mesh, ("fsdp", None), None, 1)
    return Layout(mesh, ("fsdp", None), "fsdp", num_devices)


def _param_spec(tensor: torch.Tensor, layout: Layout) -> tuple[Any, ...] | None:
    """The shard axis on the tensor's largest dimension (FSDPv2's `shard_maximal`; the first of equal
    ones), whether or not it divides evenly; None (replicated) under ddp and for scalars."""
    if layout.param_axis is None or tensor.dim() == 0:
        return None
    spec: list[Any] = [None] * tensor.dim()
    spec[list(tensor.shape).index(max(tensor.shape))] = layout.param_axis
    return tuple(spec)


def shard_parameters(model: nn.Module, layout: Layout) -> int:
    """Marks every parameter (see `_param_spec`); returns how many were sharded."""
    import torch_xla.distributed.spmd as xs

    sharded = 0
    for param in model.parameters():
        spec = _param_spec(param, layout)
        if spec is not None:
            xs.mark_sharding(param, layout.mesh, spec)
            sharded += 1
    return sharded


def shard_blocks(model: nn.Module, layout: Layout) -> int:
    """FSDPv2's per-layer pieces on each block of `model.blocks`: its output marked sharded along the batch
    (the batch's own spec), and an optimization barrier at the end of its backward. Returns the number of
    blocks."""
    import torch_xla.distributed.spmd as xs

    blocks = model_blocks(model)
    batch_axes = layout.batch_spec[0]

    def shard_output(_module: nn.Module, _inputs: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, tuple) else output
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
            xs.mark_sharding(tensor, layout.mesh, (batch_axes,) + (None,) * (tensor.dim() - 1))

    for block in blocks:
        block.register_forward_hook(shard_output)
        xs.apply_backward_optimization_barrier(block)
    return len(blocks)


def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout) -> None:
    """AdamW's state as its first step would create it (step 0, zero moments), each moment sharded as its
    parameter, before the first step. Created inside the step instead, the moments would be laid out by
    the compiler, and sharding them afterwards would make the second step compile another graph."""
    import torch_xla

    if not isinstance(optimizer, torch.optim.AdamW):
        raise BatchpilotError(
            "train.runtime",
            f"is xla, whose optimizer state is laid out for AdamW, not {type(optimizer).__name__}",
            "train with AdamW (make_optimizer)",
        )
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            state: dict[str, torch.Tensor] = {"step": torch.tensor(0.0)}
            names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            for name in names:
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
            optimizer.state[param] = state
    shard_optimizer_state(model, optimizer, layout)
    torch_xla.sync()  # the zeros become device data: a pending zeros_like would be part of the first step


def shard_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout) -> None:
    """AdamW's moments laid out as their parameters (so they are sharded too, and DCP loads into shards)."""
    import torch_xla.distributed.spmd as xs

    for param in model.parameters():
        spec = _param_spec(param, layout)
        state = optimizer.state.get(param, {})
        for value in state.values():
            if spec is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                xs.mark_sharding(value, layout.mesh, spec)
