"""A process planned for an accelerator refuses to start without it, in one line that says why.

"Planned for an accelerator" is a config whose `cluster.accelerator_type` names a GPU (GKE's `nvidia-...`
labels) or a TPU (`tpu-...`), whatever its backend. Such a process that finds no device would otherwise run
on the CPU and gloo while the pool's nodes bill (gke), or train a local run on the CPU without a word.
Configs without an accelerator type (the demo, GKE CPU pools) run on the CPU as always.

On GKE the NVIDIA device plugin mounts the node's driver libraries into a GPU container at
/usr/local/nvidia (libraries in lib64, nvidia-smi in bin); CUDA finds them only through LD_LIBRARY_PATH,
which the image sets (Dockerfile). The checks are pure functions of what was found (`cuda_refusal`,
`tpu_refusal`), unit-tested without a device; `require_*` read the facts from torch, torch_xla and the
environment.
"""

from __future__ import annotations

import os
from typing import Any

from batchpilot.errors import BatchpilotError
from batchpilot.planning.tpu import is_tpu

GKE_DRIVER_LIB_DIR = "/usr/local/nvidia/lib64"
"""Where GKE's device plugin mounts the node's NVIDIA driver libraries in a GPU container."""

IMAGE_FIX = (
    "run the batchpilot image, whose Dockerfile sets LD_LIBRARY_PATH=/usr/local/nvidia/lib64:"
    "/usr/local/nvidia/lib, or set it in the container"
)


def planned_gpu(*, accelerator_type: str | None) -> bool:
    """Whether a config's processes are planned for GPUs: a gke pool with a non-TPU accelerator type."""
    return bool(accelerator_type) and not is_tpu(accelerator_type)


def planned_tpu(*, accelerator_type: str | None) -> bool:
    """Whether a config's trainers are planned for TPUs: a gke pool with a `tpu-...` accelerator type."""
    return is_tpu(accelerator_type)


def _library_path_entries(ld_library_path: str | None) -> list[str]:
    return [os.path.normpath(entry) for entry in (ld_library_path or "").split(":") if entry]


def cuda_refusal(
    *,
    accelerator_type: str,
    num_devices_needed: int,
    needed_by: str,
    is_available: bool,
    device_count: int,
    torch_version: str,
    cuda_version: str | None,
    ld_library_path: str | None,
) -> BatchpilotError | None:
    """Why a process planned for `num_devices_needed` GPUs of `accelerator_type` cannot run (None: it can).

    Args:
        needed_by: who needs them, e.g. `LOCAL_WORLD_SIZE=8 trainer processes per node`.
        is_available, device_count: `torch.cuda.is_available()` and `torch.cuda.device_count()`.
        torch_version, cuda_version: `torch.__version__` and `torch.version.cuda` (None: a CPU build).
        ld_library_path: the environment's LD_LIBRARY_PATH (None: unset).
    """
    visible = device_count if is_available else 0
    if is_available and visible >= num_devices_needed:
        return None
    found = (
        f"found {visible} (torch.cuda.is_available() is {is_available}, torch.cuda.device_count() is "
        f"{device_count})"
    )
    if cuda_version is None:
        cause = f"torch {torch_version} is a CPU build (torch.version.cuda is None)"
        fix = "build the image with TORCH_FLAVOR=cuda and a CUDA TORCH_REQUIREMENT (see the Dockerfile)"
    elif GKE_DRIVER_LIB_DIR not in _library_path_entries(ld_library_path):
        shown = ld_library_path if ld_library_path else "unset"
        cause = (
            f"the NVIDIA driver libraries are not on LD_LIBRARY_PATH (GKE mounts them at {GKE_DRIVER_LIB_DIR}; "
            f"LD_LIBRARY_PATH={shown})"
        )
        fix = IMAGE_FIX
    elif not is_available:
        cause = (
            f"CUDA {cuda_version} does not start although {GKE_DRIVER_LIB_DIR} is on LD_LIBRARY_PATH: the pod "
            "has no GPU (no nvidia.com/gpu limit, or not on a node of the GPU pool) or the node's driver is "
            "older than that CUDA"
        )
        fix = "run /usr/local/nvidia/bin/nvidia-smi in the pod to see its GPUs and driver version"
    else:
        cause = "the pod sees fewer GPUs than processes, one GPU each (its nvidia.com/gpu limit is lower)"
        fix = "set cluster.devices_per_node to the GPUs of one node of cluster.machine_type"
    return BatchpilotError(
        "cluster.accelerator_type",
        f"{accelerator_type} needs {num_devices_needed} CUDA device(s) here ({needed_by}), {found}: {cause}",
        fix,
    )


def require_cuda(*, accelerator_type: str, num_devices_needed: int, needed_by: str) -> None:
    """Raises `cuda_refusal` of this process's torch and environment, if any."""
    import torch

    refusal = cuda_refusal(
        accelerator_type=accelerator_type,
        num_devices_needed=num_devices_needed,
        needed_by=needed_by,
        is_available=torch.cuda.is_available(),
        device_count=torch.cuda.device_count(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        ld_library_path=os.environ.get("LD_LIBRARY_PATH"),
    )
    if refusal is not None:
        raise refusal


def require_planned_accelerator(*, accelerator_type: str | None, runtime: str) -> None:
    """A trainer's start: refuses a GPU plan without its GPUs, and a TPU plan whose environment does not
    ask PJRT for the TPU (the XLA runtime's start then checks the chips: `require_tpu`)."""
    if planned_gpu(accelerator_type=accelerator_type) and runtime == "eager":
        assert accelerator_type is not None
        from batchpilot.train.distributed import processes_per_node_from_env

        processes = processes_per_node_from_env()
        require_cuda(
            accelerator_type=accelerator_type,
            num_devices_needed=processes,
            needed_by=f"LOCAL_WORLD_SIZE={processes} trainer process(es) on this node, one GPU each",
        )
    elif planned_tpu(accelerator_type=accelerator_type):
        pjrt_device = os.environ.get("PJRT_DEVICE")
        if pjrt_device != "TPU":
            raise BatchpilotError(
                "cluster.accelerator_type",
                f"{accelerator_type} is a TPU but PJRT_DEVICE is {pjrt_device or 'unset'}, so torch_xla would "
                "train on another device",
                "set PJRT_DEVICE=TPU (the TPU JobSet of `batchpilot launch` does)",
            )


def tpu_refusal(
    *, pjrt_device: str | None, device_type: str | None, num_devices: int, init_error: str | None
) -> BatchpilotError | None:
    """Why a process asked to run on TPUs (`PJRT_DEVICE=TPU`) cannot (None: it can, or it was not asked).

    Args:
        pjrt_device: the environment's PJRT_DEVICE.
        device_type: torch_xla's `xr.device_type()` once its runtime started (None: it did not).
        num_devices: the devices this host addresses (`xr.addressable_runtime_device_count()`).
        init_error: the first line of the error torch_xla's runtime raised while starting, if any.
    """
    if pjrt_device != "TPU":
        return None
    if init_error is None and device_type == "TPU" and num_devices > 0:
        return None
    if init_error is not None:
        found = f"the TPU runtime did not start ({init_error})"
    else:
        found = f"torch_xla found {num_devices} device(s) of type {device_type}"
    return BatchpilotError(
        "PJRT_DEVICE",
        f"is TPU but this host has no TPU device: {found}; the pod is not on a TPU node of the slice (no "
        "google.com/tpu limit) or libtpu is missing",
        "run the trainer pods that `batchpilot launch` renders, from an image built with TORCH_FLAVOR=tpu",
    )


def require_tpu(xr: Any) -> None:
    """Raises `tpu_refusal` of this process, with `xr` torch_xla.runtime after `use_spmd()`; starts the
    runtime (which a TPU-less host fails to do, with a long error that this shortens to one line)."""
    device_type, num_devices, init_error = None, 0, None
    if os.environ.get("PJRT_DEVICE") == "TPU":
        try:
            num_devices = int(xr.addressable_runtime_device_count())
            device_type = str(xr.device_type())
        except RuntimeError as error:
            lines = str(error).strip().splitlines() or [type(error).__name__]
            init_error = lines[0][:200]
    refusal = tpu_refusal(
        pjrt_device=os.environ.get("PJRT_DEVICE"),
        device_type=device_type,
        num_devices=num_devices,
        init_error=init_error,
    )
    if refusal is not None:
        raise refusal
