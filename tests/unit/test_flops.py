"""FLOPs per token and MFU: the PaLM formula and the device table."""

import pytest

from batchpilot.planning.flops import PEAK_BF16_FLOPS, flops_per_token, mfu, peak_bf16_flops


def test_flops_per_token_is_6n_plus_attention():
    # GPT-2 small-like: 124M parameters, 12 layers, width 768, 1024 tokens.
    assert flops_per_token(num_params=124_000_000, num_layers=12, hidden_size=768, seq_len=1024) == (
        6 * 124_000_000 + 12 * 12 * 768 * 1024
    )


def test_mfu_and_device_names():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == PEAK_BF16_FLOPS["nvidia-h100-80gb"]
    assert peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") is None and peak_bf16_flops("Tesla T4") is None
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert mfu(tokens_per_s=100_000, flops_per_token=2e9, peak_flops=1e15) == pytest.approx(0.2)
