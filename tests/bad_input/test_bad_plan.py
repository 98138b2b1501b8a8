"""`batchpilot plan` and `config check` on inputs that do not belong to the config, and a plan.json edited by
hand: each refused in one line naming the field and the fix, with nothing written. Every case has a valid
twin that passes, so the check cannot be vacuous."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from harness import no_debris, run_cli

from batchpilot.config import explore_fingerprint, parse_config
from helpers import gke_a3_config, tiny_config, write_manifest

GPT2_TOKENIZER = {"kind": "huggingface", "path": "gpt2/tokenizer.json"}


def local_config(folder: Path, *, data_uri: str, **model_args: int) -> Path:
    """The tiny local config (vocab_size 257 unless given) with its data at `data_uri`, as a YAML file."""
    config = tiny_config(data_uri=data_uri, checkpoint_uri=f"file://{folder}/ckpt")
    config["model"]["args"].update(model_args)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def plan_args(config: Path, folder: Path) -> list[str]:
    return ["plan", "--config", str(config), "--out", str(folder / "plan.json")]


# --- data.uri: a local shard set that is not there ----------------------------------------------------


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_a_local_data_uri_that_does_not_exist_is_refused(tmp_path, command):
    config = local_config(tmp_path, data_uri=f"file://{tmp_path}/no-data")
    argv = plan_args(config, tmp_path) if command == "plan" else ["config", "check", str(config)]
    with no_debris(tmp_path):
        outcome = run_cli(*argv)
    outcome.assert_refused("data.uri", f"file://{tmp_path}/no-data does not exist", "batchpilot data prepare")


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_a_local_data_folder_without_a_manifest_is_refused(tmp_path, command):
    (tmp_path / "empty").mkdir()
    config = local_config(tmp_path, data_uri=f"file://{tmp_path}/empty")
    argv = plan_args(config, tmp_path) if command == "plan" else ["config", "check", str(config)]
    with no_debris(tmp_path):
        outcome = run_cli(*argv)
    outcome.assert_refused("data.uri", "holds no shard set", "manifest.json")


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_twin_a_prepared_local_shard_set_passes(tmp_path, command):
    config = local_config(tmp_path, data_uri=write_manifest(tmp_path / "data"))
    argv = plan_args(config, tmp_path) if command == "plan" else ["config", "check", str(config)]
    outcome = run_cli(*argv)
    assert outcome.code == 0, outcome.stderr
    assert (tmp_path / "plan.json").exists() == (command == "plan")


# --- the shard set's vocabulary against the model -----------------------------------------------------


def test_a_shard_set_of_a_larger_vocabulary_than_the_model_embeds_is_refused(tmp_path):
    data = write_manifest(tmp_path / "data", vocab_size=50257, tokenizer=GPT2_TOKENIZER)
    config = local_config(tmp_path, data_uri=data)  # the model embeds 257 token ids (bytes)
    with no_debris(tmp_path):
        outcome = run_cli(*plan_args(config, tmp_path))
    outcome.assert_refused(
        "model.args.vocab_size: the model embeds 257 token ids", "vocabulary has 50257", "at least 50257"
    )


def test_twin_a_model_that_embeds_the_whole_vocabulary_plans(tmp_path):
    data = write_manifest(tmp_path / "data", vocab_size=50257, tokenizer=GPT2_TOKENIZER)
    config = local_config(tmp_path, data_uri=data, vocab_size=50304)
    outcome = run_cli(*plan_args(config, tmp_path))
    assert outcome.code == 0, outcome.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["config"]["model"]["args"]["vocab_size"] == 50304


# --- explore.json measured for another model ----------------------------------------------------------


def explore_json(folder: Path, measured: dict) -> Path:
    """explore.json as `batchpilot explore` writes it for the config `measured` (recommendation and the
    fingerprint of what it measured)."""
    path = folder / "explore.json"
    fingerprint = explore_fingerprint(parse_config(measured))
    document = {"fingerprint": fingerprint, "recommendation": {"micro_batch_size": 2, "samples_per_s": 50.0}}
    path.write_text(json.dumps(document))
    return path


def gke_config_file(folder: Path, **model_args: int) -> tuple[Path, dict]:
    config = gke_a3_config()  # gs:// data: nothing local to read
    config["batch"]["micro_batch_size"] = "explore"
    config["model"]["args"].update(model_args)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def test_an_exploration_of_another_model_is_refused_naming_what_differs(tmp_path):
    path, config = gke_config_file(tmp_path)
    other = json.loads(json.dumps(config))
    other["model"]["args"]["n_layer"] = 4
    other["data"]["seq_len"] = 64
    explore = explore_json(tmp_path, other)
    with no_debris(tmp_path):
        outcome = run_cli(*plan_args(path, tmp_path), "--explore", str(explore))
    line = outcome.assert_refused(
        "--explore", "model.args.n_layer 4 there, 1 here", "data.seq_len 64 there, 32 here"
    )
    assert "batchpilot explore" in line


def test_an_exploration_on_other_devices_is_refused(tmp_path):
    path, config = gke_config_file(tmp_path)
    other = json.loads(json.dumps(config))
    other["cluster"].update(machine_type="a3-highgpu-4g", devices_per_node=4)
    explore = explore_json(tmp_path, other)
    with no_debris(tmp_path):
        outcome = run_cli(*plan_args(path, tmp_path), "--explore", str(explore))
    outcome.assert_refused("--explore", "cluster.devices_per_node 4 there, 8 here")


def test_twin_an_exploration_of_this_config_plans_with_its_micro_batch(tmp_path):
    path, config = gke_config_file(tmp_path)
    explore = explore_json(tmp_path, config)
    outcome = run_cli(*plan_args(path, tmp_path), "--explore", str(explore))
    assert outcome.code == 0, outcome.stderr
    document = json.loads((tmp_path / "plan.json").read_text())
    assert (document["micro_batch_source"], document["micro_batch_size"]) == ("explore", 2)


# --- plan.json edited by hand -------------------------------------------------------------------------


@pytest.fixture
def gke_plan(tmp_path) -> Path:
    """plan.json of the gke config, written by `batchpilot plan`."""
    path, _ = gke_config_file(tmp_path)
    plan = tmp_path / "plan.json"
    outcome = run_cli("plan", "--config", str(path), "--micro-batch-size", "2", "--out", str(plan))
    assert outcome.code == 0, outcome.stderr
    return plan


def dry_run(plan: Path):
    return run_cli("launch", "--plan", str(plan), "--stage", "0", "--dry-run")


EDITS = {
    "a stage's node count": lambda d: d["stages"][0].update(num_nodes=2),
    "a stage removed": lambda d: d["stages"].pop(1),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_a_plan_whose_stages_were_edited_is_refused(tmp_path, gke_plan, edit):
    data = json.loads(gke_plan.read_text())
    edit(data)
    gke_plan.write_text(json.dumps(data, indent=2))
    with no_debris(tmp_path):
        outcome = dry_run(gke_plan)
    outcome.assert_refused(str(gke_plan), "were edited after batchpilot wrote it", "batchpilot plan --config")


def test_twin_an_untouched_plan_renders_its_jobset(gke_plan):
    outcome = dry_run(gke_plan)
    assert outcome.code == 0, outcome.stderr
    assert yaml.safe_load(outcome.stdout)["kind"] == "JobSet"


# --- train.init_from: a Hugging Face checkpoint that does not fit the config --------------------------

HF_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
"""config.json of a LlamaForCausalLM as transformers writes it (the plan reads nothing else of the folder)."""
HF_LLAMA_ARGS = {
    "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 64, "vocab_size": 300,
    "ffn_hidden_size": 128, "rope_theta": 10000.0, "norm_eps": 1e-6,
}  # fmt: skip


def init_from_config(folder: Path, *, hf_config: dict | None = None, **changes: object) -> Path:
    """The tiny config as a Llama of HF_LLAMA_ARGS starting from a checkpoint folder with `hf_config` (default
    HF_LLAMA_CONFIG) and a weights file; `changes` update model.args, or with `factory`/`init_from` those."""
    checkpoint = folder / "hf"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text(json.dumps(hf_config or HF_LLAMA_CONFIG))
    (checkpoint / "model.safetensors").write_bytes(b"")
    config = tiny_config(data_uri=write_manifest(folder / "data"), checkpoint_uri=f"file://{folder}/ckpt")
    factory = changes.pop("factory", "batchpilot.models.llama:build")
    config["train"]["init_from"] = changes.pop("init_from", str(checkpoint))
    config["model"] = {"factory": factory, "args": {**HF_LLAMA_ARGS, **changes}}
    if factory != "batchpilot.models.llama:build":
        config["model"]["args"] = {
            "n_layer": 1,
            "n_head": 2,
            "n_embd": 32,
            "block_size": 32,
            "vocab_size": 257,
        }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_an_init_from_checkpoint_of_another_shape_is_refused(tmp_path, command):
    config = init_from_config(tmp_path, n_layer=4)
    argv = plan_args(config, tmp_path) if command == "plan" else ["config", "check", str(config)]
    with no_debris(tmp_path):
        outcome = run_cli(*argv)
    outcome.assert_refused(
        "model.args.n_layer: is 4 but", f"{tmp_path}/hf/config.json has num_hidden_layers 2",
        "set model.args.n_layer: 2",
    )  # fmt: skip


def test_an_init_from_checkpoint_of_another_architecture_is_refused(tmp_path):
    config = init_from_config(
        tmp_path, hf_config={**HF_LLAMA_CONFIG, "architectures": ["MistralForCausalLM"]}
    )
    with no_debris(tmp_path):
        outcome = run_cli(*plan_args(config, tmp_path))
    outcome.assert_refused("train.init_from", "MistralForCausalLM", "LlamaForCausalLM")


def test_an_init_from_folder_that_does_not_exist_is_refused(tmp_path):
    config = init_from_config(tmp_path, init_from=str(tmp_path / "nowhere"))
    with no_debris(tmp_path):
        outcome = run_cli(*plan_args(config, tmp_path))
    outcome.assert_refused("train.init_from", f"{tmp_path}/nowhere does not exist")


def test_init_from_with_the_gpt_factory_is_refused(tmp_path):
    config = init_from_config(tmp_path, factory="batchpilot.models.gpt:build")
    with no_debris(tmp_path):
        outcome = run_cli(*plan_args(config, tmp_path))
    outcome.assert_refused("train.init_from", "model.factory is batchpilot.models.gpt:build", "llama:build")


def test_init_from_another_uri_scheme_is_refused(tmp_path):
    config = init_from_config(tmp_path, init_from="s3://bucket/llama")
    with no_debris(tmp_path):
        outcome = run_cli("config", "check", str(config))
    outcome.assert_refused("train: init_from 's3://bucket/llama'", "local folder, file:// or gs:// only")


def test_init_from_a_local_folder_on_gke_is_refused(tmp_path):
    path = init_from_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["cluster"].update(
        backend="gke", project="p", location="us-central1", cluster_name="c", node_pool="np",
        accelerator_type="nvidia-l4", machine_type="g2-standard-4", image="registry.example/batchpilot:1",
    )  # fmt: skip
    # file:// data and checkpoints are refused on gke too: only init_from is wrong here
    config["data"]["uri"] = "gs://bucket/data"
    config["train"]["checkpoint_uri"] = "gs://bucket/ckpt"
    path.write_text(yaml.safe_dump(config))
    with no_debris(tmp_path):
        outcome = run_cli("config", "check", str(path))
    outcome.assert_refused("train.init_from", "trainer pods on gke do not see", "use a gs:// folder")


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_twin_an_init_from_checkpoint_of_the_configs_shape_passes(tmp_path, command):
    config = init_from_config(tmp_path)
    argv = plan_args(config, tmp_path) if command == "plan" else ["config", "check", str(config)]
    outcome = run_cli(*argv)
    assert outcome.code == 0, outcome.stderr


# --- flex-start and an explore task -------------------------------------------------------------------


def flex_config(folder: Path, **explore: object) -> Path:
    config = gke_a3_config(provisioning="flex-start")
    config["explore"] = dict(explore)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("command", ["plan", "config check", "compile"])
def test_flex_start_with_an_explore_task_is_refused_before_anything_is_asked_for(tmp_path, command):
    config = flex_config(tmp_path, study=True)  # the study needs the explore task, which has no node there
    argv = {
        "plan": plan_args(config, tmp_path),
        "config check": ["config", "check", str(config)],
        "compile": ["compile", "--config", str(config), "--out", str(tmp_path / "pipeline.yaml")],
    }[command]
    with no_debris(tmp_path):
        outcome = run_cli(*argv)
    outcome.assert_refused(
        "cluster.provisioning: is flex-start, whose pool's nodes come only through a ProvisioningRequest",
        "explore.study on, which the pipeline's explore task measures on a node of that pool",
        "set an integer batch.micro_batch_size and explore.study: false",
    )


def test_twin_flex_start_with_a_fixed_micro_batch_and_no_study_plans(tmp_path):
    outcome = run_cli(*plan_args(flex_config(tmp_path, study=False), tmp_path))
    assert outcome.code == 0, outcome.stderr
