"""The accelerators batchpilot knows: memory and dense bf16 peak, keyed by the GKE accelerator label.

The key is `cluster.accelerator_type` (the `cloud.google.com/gke-accelerator` node label). Memory is what
the device reports as its total (`nvidia-smi --query-gpu=memory.total`, in MiB), not the data sheet's
rounded figure: an "80GB" H100 reports 81559 MiB (79.6 GiB), an "141GB" H200 143771 MiB (140.4 GiB).
PyTorch sees a little less again (the CUDA context takes a few hundred MiB), which the memory model's
reserve covers (`batchpilot.planning.memory`). Peaks are dense (no structured sparsity) bf16
tensor-core FLOP/s from NVIDIA's data sheets; a device without bf16 has None. TPU chips (one device per
chip) come from the TPU table in `batchpilot.planning.tpu`. B200 is left out until its
reported memory has been checked on a real device.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.planning.tpu import TPU_TYPES

_MIB = 2**20


@dataclass(frozen=True)
class Device:
    """One accelerator type.

    Attributes:
        label: the GKE accelerator label, e.g. `nvidia-h100-80gb`.
        memory_bytes: total memory of one device as the device reports it.
        peak_bf16_flops: dense bf16 tensor-core peak in FLOP/s; None when the device has no bf16.
    """

    label: str
    memory_bytes: int
    peak_bf16_flops: float | None


DEVICES: dict[str, Device] = {
    device.label: device
    for device in (
        # H100 SXM5 80GB HBM3 (A3 High): 81559 MiB reported; 989.4 TFLOPS bf16 dense.
        Device("nvidia-h100-80gb", 81559 * _MIB, 989.4e12),
        # The same H100 SXM5 in A3 Mega machines.
        Device("nvidia-h100-mega-80gb", 81559 * _MIB, 989.4e12),
        # H200 SXM 141GB HBM3e: 143771 MiB reported; H100's compute, so the same peak.
        Device("nvidia-h200-141gb", 143771 * _MIB, 989.4e12),
        # A100 SXM4 80GB (A2 Ultra): 81920 MiB reported; 312 TFLOPS bf16 dense.
        Device("nvidia-a100-80gb", 81920 * _MIB, 312e12),
        # A100 SXM4 40GB (A2 High): 40960 MiB reported.
        Device("nvidia-tesla-a100", 40960 * _MIB, 312e12),
        # L4 24GB GDDR6 (G2): 23034 MiB reported; 121 TFLOPS bf16 dense (242 with sparsity).
        Device("nvidia-l4", 23034 * _MIB, 121e12),
        # T4 16GB GDDR6 (N1): 15360 MiB reported; Turing has no bf16 (65 TFLOPS fp16 dense).
        Device("nvidia-tesla-t4", 15360 * _MIB, None),
    )
}
"""The device table, by GKE accelerator label."""

PEAK_BF16_FLOPS: dict[str, float] = {
    label: device.peak_bf16_flops for label, device in DEVICES.items() if device.peak_bf16_flops is not None
}
"""Dense bf16 peak FLOP/s by GKE accelerator label (devices with bf16 only)."""


def device_memory_bytes(accelerator_type: str | None, override: int | None = None) -> int | None:
    """Memory of one device: `override` (`cluster.device_memory_bytes`) when given, else the table's.

    Returns None for an unknown or missing accelerator with no override.
    """
    if override is not None:
        return override
    device = DEVICES.get(accelerator_type) if accelerator_type else None
    tpu = TPU_TYPES.get(accelerator_type) if accelerator_type else None
    return device.memory_bytes if device else tpu.memory_bytes if tpu else None


def device_peak_flops(accelerator_type: str | None, override: float | None = None) -> float | None:
    """Dense bf16 peak of one device: `override` (`cluster.device_peak_flops`) when given, else the table's.

    Returns None for an unknown or missing accelerator, or one without bf16, with no override.
    """
    if override is not None:
        return override
    device = DEVICES.get(accelerator_type) if accelerator_type else None
    tpu = TPU_TYPES.get(accelerator_type) if accelerator_type else None
    return device.peak_bf16_flops if device else tpu.peak_bf16_flops if tpu else None


def nearest_names(name: str, known: list[str] | tuple[str, ...], *, count: int = 3) -> list[str]:
    """The known names closest to a mistyped one (difflib's ratio), at most `count`; the first few known
    names when none is close."""
    import difflib

    close = difflib.get_close_matches(name, known, n=count, cutoff=0.5)
    return close or list(known)[:count]


def accelerator_problem(
    accelerator_type: str | None, *, device_memory_bytes: int | None, is_tpu_type: bool
) -> tuple[str, str] | None:
    """(problem, fix) for a GPU label the device table does not have while the config gives no memory of its
    own (`cluster.device_memory_bytes`): the plan would size every stage on a guess, and a pipeline pinned
    to a label GKE does not have never schedules. None when the label is known, a TPU, or absent."""
    if not accelerator_type or accelerator_type in DEVICES or is_tpu_type or device_memory_bytes is not None:
        return None
    nearest = ", ".join(nearest_names(accelerator_type, tuple(DEVICES)))
    return (
        f"{accelerator_type!r} is not a GPU batchpilot knows (nearest: {nearest})",
        "use one of those GKE accelerator labels, or for another GPU set cluster.device_memory_bytes (and "
        "cluster.device_peak_flops for MFU)",
    )
