"""batchpilot's models as Hugging Face checkpoints: the mapping round-trips, transformers computes the same
logits from the files, and what has no counterpart is refused in one line."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from batchpilot.errors import BatchpilotError
from batchpilot.models import hf
from batchpilot.models.factory import build_model

LLAMA_ARGS = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 32, "vocab_size": 300}
GPT_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 300}


def llama(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return spread(build_model(factory=hf.LLAMA_FACTORY, args={**LLAMA_ARGS, **overrides}).eval())


def spread(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter ~ N(0, 0.3): no norm weight stays 1 and no bias 0 (a swapped norm or bias would not
    show otherwise), and activations large enough that GELU's tanh approximation differs by > 1e-4."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    return model


def export(tmp_path, factory: str, args: dict, model: torch.nn.Module, **kwargs) -> list:
    config = hf.hf_config_for(factory, args)
    return hf.write_hf_checkpoint(
        tmp_path, config, hf.to_hf_state_dict(factory, args, model.state_dict()), **kwargs
    )


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [False, True])
def test_llama_round_trips_through_files(tmp_path, tie):
    model = llama(tie_embeddings=tie, rope_theta=10000.0, norm_eps=1e-6)
    args = {**LLAMA_ARGS, "tie_embeddings": tie, "rope_theta": 10000.0, "norm_eps": 1e-6}
    written = export(tmp_path, hf.LLAMA_FACTORY, args, model)
    assert [p.name for p in written] == ["config.json", "model.safetensors"]
    factory, read_args, state = hf.from_hf_state_dict(*hf.read_hf_checkpoint(tmp_path))
    assert factory == hf.LLAMA_FACTORY
    ffn = model.config.resolved_ffn_hidden_size
    assert read_args == {**args, "ffn_hidden_size": ffn}
    again = build_model(factory=factory, args=read_args)
    again.load_state_dict(state)  # strict: every key, no extra
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_llama_args_from_hf_config_round_trip():
    args = {
        **LLAMA_ARGS,
        "ffn_hidden_size": 96,
        "rope_theta": 500000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": True,
    }
    assert hf.llama_args_from_hf_config(hf.hf_config_for(hf.LLAMA_FACTORY, args)) == args


def test_sharded_write_has_an_index_and_reads_back(tmp_path):
    model = llama()
    written = export(tmp_path, hf.LLAMA_FACTORY, LLAMA_ARGS, model, max_shard_bytes=200_000)
    shards = [p.name for p in written if p.suffix == ".safetensors"]
    assert len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
    state = hf.to_hf_state_dict(hf.LLAMA_FACTORY, LLAMA_ARGS, model.state_dict())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    _, read = hf.read_hf_checkpoint(tmp_path)
    assert all(torch.equal(read[name], state[name]) for name in state)


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_llama_computes_batchpilots_logits(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    model = llama(tie_embeddings=tie)
    export(tmp_path, hf.LLAMA_FACTORY, {**LLAMA_ARGS, "tie_embeddings": tie}, model)
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, torch_dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    ids = tokens()
    with torch.no_grad():
        difference = (theirs.eval()(ids).logits - model(ids)).abs().max().item()
    assert difference <= 1e-4


@pytest.mark.parametrize("bias", [True, False])
def test_transformers_gpt2_computes_batchpilots_logits(tmp_path, bias):
    transformers = pytest.importorskip("transformers")
    args = {**GPT_ARGS, "bias": bias}
    torch.manual_seed(0)
    model = spread(build_model(factory=hf.GPT_FACTORY, args=args).eval())
    export(tmp_path, hf.GPT_FACTORY, args, model)
    theirs, info = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, torch_dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    ids = tokens()
    with torch.no_grad():
        difference = (theirs.eval()(ids).logits - model(ids)).abs().max().item()
    assert difference <= 1e-4


def test_unknown_factory_is_refused():
    with pytest.raises(
        BatchpilotError, match=r"^model.factory: my.models:build has no Hugging Face counterpart"
    ):
        hf.hf_config_for("my.models:build", {})


def test_a_mistral_config_is_refused_naming_it():
    config = {**hf.hf_config_for(hf.LLAMA_FACTORY, LLAMA_ARGS), "architectures": ["MistralForCausalLM"]}
    config["model_type"] = "mistral"
    with pytest.raises(BatchpilotError) as error:
        hf.llama_args_from_hf_config(config)
    assert str(error.value) == (
        "config.json: describes a MistralForCausalLM (model_type mistral); batchpilot reads LlamaForCausalLM"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("head_dim", 32),
    ],
)
def test_llama_features_batchpilot_lacks_are_refused_naming_the_field(field, value):
    config = {**hf.hf_config_for(hf.LLAMA_FACTORY, LLAMA_ARGS), field: value}
    with pytest.raises(BatchpilotError, match=rf"^config.json: sets {field} "):
        hf.from_hf_state_dict(config, {})


def test_weights_of_another_shape_of_model_are_refused():
    model = llama()
    state = hf.to_hf_state_dict(hf.LLAMA_FACTORY, LLAMA_ARGS, model.state_dict())
    config = hf.hf_config_for(hf.LLAMA_FACTORY, {**LLAMA_ARGS, "n_layer": 1})
    with pytest.raises(BatchpilotError, match=r"^weights: hold model.layers.1.input_layernorm.weight"):
        hf.from_hf_state_dict(config, state)


def test_missing_files_are_one_line(tmp_path):
    with pytest.raises(BatchpilotError, match=r"config.json: does not exist"):
        hf.read_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        BatchpilotError, match=r"has neither model.safetensors nor model.safetensors.index.json"
    ):
        hf.read_hf_checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(BatchpilotError, match=r"pytorch_model.bin \(a pickle\)"):
        hf.read_hf_checkpoint(tmp_path)


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # what an import finds when the package is absent
    with pytest.raises(BatchpilotError) as error:
        export(tmp_path, hf.LLAMA_FACTORY, LLAMA_ARGS, llama())
    assert str(error.value) == (
        "safetensors: is not installed; Hugging Face checkpoints need it (fix: pip install 'batchpilot[hf]')"
    )
    assert list(tmp_path.iterdir()) == []
