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


def test_device_names_match_exactly():
    """A device whose name contains a known one is another device (L40S is not an L4, H100 NVL not the SXM)."""
    assert peak_bf16_flops("NVIDIA L40S") is None
    assert peak_bf16_flops("NVIDIA H100 NVL") is None
    assert peak_bf16_flops("NVIDIA A100-SXM4-40GB") == PEAK_BF16_FLOPS["nvidia-tesla-a100"]
    assert peak_bf16_flops("NVIDIA L4") == PEAK_BF16_FLOPS["nvidia-l4"]


def test_6n_leaves_out_an_untied_embedding_and_keeps_a_tied_one():
    """torchtitan's count: N is the parameters that multiply. Llama-3-8B's shape (untied, vocab 128,256,
    width 4096): its 525M-parameter input embedding is a lookup; a tied embedding is the head's matrix."""
    from batchpilot.train.shape import model_shape

    llama = {"n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 32, "vocab_size": 300}
    untied = model_shape(factory="batchpilot.models.llama:build", args=llama)
    tied = model_shape(factory="batchpilot.models.llama:build", args={**llama, "tie_embeddings": True})
    assert untied.matmul_params == untied.num_params - 300 * 64
    assert tied.matmul_params == tied.num_params == untied.num_params - 300 * 64
    gpt = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 50}
    shape = model_shape(factory="batchpilot.models.gpt:build", args=gpt)
    assert shape.matmul_params == shape.num_params - 16 * 32  # the position embedding; wte is the tied head
