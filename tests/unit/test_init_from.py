"""`train.init_from`: a Hugging Face Llama checkpoint, written by real `transformers`, loaded by the trainer's
own path (`load_init_from`) computes the same logits; a checkpoint that does not fit the config is refused in
one line naming the field, both values and the fix, before any training starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchpilot.config import Config, ConfigError, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.models.factory import build_model
from batchpilot.plan.init_from import init_from_problems
from batchpilot.train.init_from import load_init_from
from helpers import tiny_config
from hf_files import LLAMA_ARGS, LLAMA_FACTORY, max_logits_difference, write_hf_llama

LLAMA = LLAMA_FACTORY
ARGS = LLAMA_ARGS  # the shape of write_hf_llama's model


def llama_config(tmp_path: Path, *, init_from: str | None, **overrides: object) -> Config:
    """The tiny config with the Llama of `ARGS` (`model__args` and others overridden) starting from
    `init_from`; data and checkpoints are never read."""
    config = tiny_config(data_uri=f"file://{tmp_path}/data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"] = {"factory": LLAMA, "args": dict(ARGS)}
    config["train"]["init_from"] = init_from
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return parse_config(config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, Path]:
    """tied -> the folder of a transformers Llama checkpoint."""
    root = tmp_path_factory.mktemp("hf")
    return {tied: write_hf_llama(root / f"tied-{tied}", tied=tied) for tied in (False, True)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_loaded_model_computes_transformers_logits(tmp_path, checkpoints, tied):
    folder = checkpoints[tied]
    config = llama_config(tmp_path, init_from=str(folder), model__args={**ARGS, "tie_embeddings": tied})
    assert init_from_problems(config) == []
    torch.manual_seed(1)
    model = build_model(factory=config.model.factory, args=config.model.args)
    assert (
        load_init_from(model, config=config, folder=folder) == 2 + 9 * 2 + 1
    )  # embedding, blocks, norm, head
    assert max_logits_difference(model, folder) <= 1e-4
    assert (model.output.weight is model.tok_embeddings.weight) == tied


def test_a_shape_that_differs_names_each_field_both_values_and_the_fix(tmp_path, checkpoints):
    folder = checkpoints[False]
    config = llama_config(
        tmp_path, init_from=str(folder), model__args={**ARGS, "n_layer": 4, "norm_eps": 1e-5}
    )
    lines = [str(problem) for problem in init_from_problems(config)]
    assert lines == [
        f"model.args.n_layer: is 4 but {folder}/config.json has num_hidden_layers 2 "
        "(fix: set model.args.n_layer: 2)",
        f"model.args.norm_eps: is 1e-05 but {folder}/config.json has rms_norm_eps 1e-06 "
        "(fix: set model.args.norm_eps: 1e-06)",
    ]


def test_the_trainer_refuses_the_mismatch_before_loading(tmp_path, checkpoints):
    config = llama_config(tmp_path, init_from=str(checkpoints[True]), model__args=ARGS)  # untied model
    model = build_model(factory=config.model.factory, args=config.model.args)
    before = model.tok_embeddings.weight.clone()
    with pytest.raises(
        BatchpilotError, match=r"model\.args\.tie_embeddings: is false but .* tie_word_embeddings true"
    ):
        load_init_from(model, config=config, folder=checkpoints[True])
    assert torch.equal(model.tok_embeddings.weight, before)


def test_the_default_ffn_width_is_compared_as_the_model_resolves_it(tmp_path, checkpoints):
    args = {key: value for key, value in ARGS.items() if key != "ffn_hidden_size"}  # Llama's rule: 256
    config = llama_config(tmp_path, init_from=str(checkpoints[False]), model__args=args)
    (line,) = [str(problem) for problem in init_from_problems(config)]
    assert "model.args.ffn_hidden_size: is 256 but" in line and "intermediate_size 128" in line


def test_another_architecture_is_refused_in_one_line(tmp_path, checkpoints):
    folder = tmp_path / "mistral"
    shutil.copytree(checkpoints[False], folder)
    hf_config = json.loads((folder / "config.json").read_text())
    hf_config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (folder / "config.json").write_text(json.dumps(hf_config))
    (problem,) = init_from_problems(llama_config(tmp_path, init_from=str(folder)))
    assert problem.field == "train.init_from"
    assert "MistralForCausalLM" in problem.problem and "LlamaForCausalLM" in problem.problem


def test_a_gpt2_config_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    (folder / "model.safetensors").write_bytes(b"")
    (problem,) = init_from_problems(llama_config(tmp_path, init_from=str(folder)))
    assert problem.field == "train.init_from" and "GPT2LMHeadModel" in problem.problem


def test_missing_folder_config_and_weights_are_each_named(tmp_path, checkpoints):
    missing = tmp_path / "nowhere"
    (problem,) = init_from_problems(llama_config(tmp_path, init_from=str(missing)))
    assert str(problem) == (
        f"train.init_from: {missing} does not exist (fix: give the folder of a Hugging Face Llama checkpoint)"
    )
    no_config = tmp_path / "no-config"
    shutil.copytree(checkpoints[False], no_config)
    (no_config / "config.json").unlink()
    (problem,) = init_from_problems(llama_config(tmp_path, init_from=str(no_config)))
    assert problem.field == "train.init_from" and f"{no_config} has no config.json" in problem.problem
    no_weights = tmp_path / "no-weights"
    shutil.copytree(checkpoints[False], no_weights)
    (no_weights / "model.safetensors").unlink()
    (problem,) = init_from_problems(llama_config(tmp_path, init_from=f"file://{no_weights}"))
    assert problem.field == "train.init_from" and "has neither model.safetensors" in problem.problem


def test_a_max_seq_len_shorter_than_the_samples_is_refused(tmp_path, checkpoints):
    config = llama_config(
        tmp_path, init_from=str(checkpoints[False]), model__args={**ARGS, "max_seq_len": 16}
    )  # data.seq_len is 32
    (problem,) = init_from_problems(config)
    assert str(problem) == (
        "model.args.max_seq_len: is 16, shorter than data.seq_len 32 (fix: set model.args.max_seq_len: 64)"
    )


def test_the_gpt_factory_and_a_local_folder_on_gke_are_refused_and_xla_is_not(tmp_path, checkpoints):
    folder = str(checkpoints[False])
    config = tiny_config(data_uri=f"file://{tmp_path}/data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["train"]["init_from"] = folder
    (problem,) = init_from_problems(parse_config(config))
    assert (
        problem.field == "train.init_from"
        and "model.factory is batchpilot.models.gpt:build" in problem.problem
    )
    assert init_from_problems(llama_config(tmp_path, init_from=folder, train__runtime="xla")) == []
    (problem,) = init_from_problems(llama_config(tmp_path, init_from=folder, cluster__backend="gke"))
    assert str(problem) == (
        f"train.init_from: is the local folder {folder}, which the trainer pods on gke do not see "
        f"(fix: use a gs:// folder (gcloud storage cp -r {folder} gs://BUCKET/PATH))"
    )


def test_another_uri_scheme_is_refused_when_the_config_is_read(tmp_path):
    with pytest.raises(ConfigError) as error:
        llama_config(tmp_path, init_from="s3://bucket/llama")
    (line,) = error.value.lines
    assert line == (
        "train: init_from 's3://bucket/llama': a checkpoint is read from a local folder, file:// or gs:// only; "
        "copy it to a gs:// folder or a local one"
    )
    assert llama_config(tmp_path, init_from="gs://bucket/llama").train.init_from == "gs://bucket/llama"


def test_a_sharded_checkpoint_loads_tensor_by_tensor_with_transformers_logits(tmp_path):
    folder = write_hf_llama(tmp_path / "sharded", tied=False, max_shard_size="100KB")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    config = llama_config(tmp_path, init_from=str(folder), model__args=ARGS)
    model = build_model(factory=config.model.factory, args=config.model.args)
    assert load_init_from(model, config=config, folder=folder) == 21
    assert max_logits_difference(model, folder) <= 1e-4


def test_a_tied_head_that_differs_from_the_embedding_is_refused(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tied-but-not"
    shutil.copytree(checkpoints[True], folder)
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1.0
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = llama_config(tmp_path, init_from=str(folder), model__args={**ARGS, "tie_embeddings": True})
    model = build_model(factory=config.model.factory, args=config.model.args)
    with pytest.raises(BatchpilotError, match=r"lm_head\.weight differs from the embedding"):
        load_init_from(model, config=config, folder=folder)
