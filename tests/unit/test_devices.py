"""The device table: memory and bf16 peak by GKE accelerator label, and the config's overrides."""

import dataclasses

import pytest

from batchpilot.planning import flops
from batchpilot.planning.devices import (
    DEVICES,
    PEAK_BF16_FLOPS,
    Device,
    device_memory_bytes,
    device_peak_flops,
)

GIB = 2**30


def test_memory_is_what_the_device_reports_a_little_under_the_label():
    h100 = device_memory_bytes("nvidia-h100-80gb")
    assert h100 == 81559 * 2**20 and 79 * GIB < h100 < 80 * GIB
    assert device_memory_bytes("nvidia-h100-mega-80gb") == h100
    assert 140 * GIB < device_memory_bytes("nvidia-h200-141gb") < 141 * GIB
    assert device_memory_bytes("nvidia-a100-80gb") == 80 * GIB
    assert device_memory_bytes("nvidia-tesla-a100") == 40 * GIB  # GKE's A100 40GB label
    assert 22 * GIB < device_memory_bytes("nvidia-l4") < 23 * GIB
    assert device_memory_bytes("nvidia-tesla-t4") == 15 * GIB


def test_peaks_are_dense_bf16_and_t4_has_none():
    assert device_peak_flops("nvidia-h100-80gb") == 989.4e12
    assert device_peak_flops("nvidia-h200-141gb") == 989.4e12
    assert device_peak_flops("nvidia-tesla-a100") == device_peak_flops("nvidia-a100-80gb") == 312e12
    assert device_peak_flops("nvidia-l4") == 121e12
    assert device_peak_flops("nvidia-tesla-t4") is None
    assert "nvidia-tesla-t4" not in PEAK_BF16_FLOPS


def test_overrides_win_and_unknown_accelerators_give_none():
    assert device_memory_bytes("nvidia-h100-80gb", 40 * GIB) == 40 * GIB
    assert device_memory_bytes("nvidia-made-up", 24 * GIB) == 24 * GIB
    assert device_memory_bytes(None, 2 * GIB) == 2 * GIB
    assert device_peak_flops("nvidia-tesla-t4", 65e12) == 65e12
    assert device_peak_flops("nvidia-l4", 100e12) == 100e12
    for label in ("nvidia-made-up", "", None):
        assert device_memory_bytes(label) is None and device_peak_flops(label) is None


def test_one_table_feeds_the_mfu_peaks():
    assert flops.PEAK_BF16_FLOPS is PEAK_BF16_FLOPS
    assert sorted(PEAK_BF16_FLOPS) == [
        "nvidia-a100-80gb",
        "nvidia-h100-80gb",
        "nvidia-h100-mega-80gb",
        "nvidia-h200-141gb",
        "nvidia-l4",
        "nvidia-tesla-a100",
    ]
    assert flops.peak_bf16_flops("NVIDIA L4") == DEVICES["nvidia-l4"].peak_bf16_flops
    assert all(label == device.label for label, device in DEVICES.items())


def test_devices_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEVICES["nvidia-l4"].memory_bytes = 1  # type: ignore[misc]
    assert Device("x", 1, None) == Device("x", 1, None)
