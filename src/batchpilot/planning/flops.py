"""Model FLOPs per token and MFU (model FLOPs utilisation): the share of a device's peak that training uses.

Training FLOPs per token of a decoder-only transformer: 6N for the weight matrix multiplies of the
forward pass (2N) and the backward pass (4N), plus 12 x layers x width x sequence length for attention's
score and value products (Chowdhery et al. 2022, PaLM, appendix B). N counts the parameters that multiply
(torchtitan's count): an untied token embedding (and a position embedding) is a lookup and is left out; a
tied one is the output head's matrix and stays. Activation checkpointing recomputes the forward pass, but
MFU counts the model's FLOPs only, so it is not added.
"""

from __future__ import annotations

from batchpilot.planning.devices import PEAK_BF16_FLOPS

__all__ = ["PEAK_BF16_FLOPS", "flops_per_token", "mfu", "peak_bf16_flops"]

_DEVICE_NAMES: dict[str, str | None] = {
    # torch.cuda.get_device_name() -> GKE accelerator label, matched exactly: a name that merely contains
    # another ("NVIDIA L40S" and L4, "NVIDIA H100 NVL" and H100) is another device with another peak.
    "NVIDIA H100 80GB HBM3": "nvidia-h100-80gb",  # A3 High and A3 Mega (the same H100 SXM5)
    "NVIDIA H200": "nvidia-h200-141gb",
    "NVIDIA A100-SXM4-80GB": "nvidia-a100-80gb",
    "NVIDIA A100-SXM4-40GB": "nvidia-tesla-a100",
    "NVIDIA L4": "nvidia-l4",
    "Tesla T4": None,  # no bf16
    "NVIDIA H100 PCIe": None,  # 756 TFLOPS: not a GKE accelerator, so not in the table
}


def flops_per_token(*, num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) of a decoder-only transformer."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a CUDA device by its exact name (`torch.cuda.get_device_name()`), if known
    (otherwise `cluster.device_peak_flops` gives it)."""
    label = _DEVICE_NAMES.get(device_name.strip())
    return PEAK_BF16_FLOPS.get(label) if label else None


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOPs per second over the device's peak."""
    return tokens_per_s * flops_per_token / peak_flops
