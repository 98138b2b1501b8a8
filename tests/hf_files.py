"""Hugging Face files the tests start from, written by the real libraries: a small `LlamaForCausalLM` saved
by `transformers` (safetensors, whole or in shards) and a byte-level BPE tokenizer.json trained by
`tokenizers`; and the logits check every Hugging Face round trip ends with."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA_FACTORY = "batchpilot.models.llama:build"
LLAMA_ARGS = {
    "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 64, "vocab_size": 300,
    "ffn_hidden_size": 128, "rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False,
}  # fmt: skip
"""The shape of `write_hf_llama`'s model, as batchpilot's model.args."""


def write_hf_llama(
    folder: Path,
    *,
    tied: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
    std: float | None = None,
) -> Path:
    """A LlamaForCausalLM of `LLAMA_ARGS`' shape saved by transformers into `folder`.

    The norm weights are random (0.5 to 1.5), so that a norm loaded into the wrong place changes the logits;
    with `std` every other weight is drawn from N(0, std) too, far from an untrained model, so that its loss
    tells it apart from a freshly initialised one. `max_shard_size` (e.g. "100KB") writes shards and
    model.safetensors.index.json.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif std is not None:
                parameter.normal_(0.0, std)
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def max_logits_difference(model: torch.nn.Module, folder: Path, *, seed: int = 2) -> float:
    """The largest |logit| difference between batchpilot's `model` and transformers' model loaded from
    `folder` (LlamaForCausalLM or GPT2LMHeadModel, by its config.json), in fp32 on the same random tokens."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(
        0, reference.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        ours = model.eval()(tokens)
        theirs = reference(input_ids=tokens).logits
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return (ours - theirs).abs().max().item()


def bpe_tokenizer_json(documents: list[str], *, vocab_size: int, special_tokens: list[str]) -> bytes:
    """A byte-level BPE tokenizer.json trained on `documents` (its special tokens take the first ids)."""
    import tokenizers

    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=special_tokens[0]))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(documents, trainer=trainer)
    return model.to_str().encode()
