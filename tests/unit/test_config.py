"""The config tree: example configs load, and every invalid input names the key path."""

import copy
from pathlib import Path

import pytest
import yaml

from batchpilot.config import (
    ConfigError,
    MaxTextRampup,
    MegatronRampup,
    config_schema,
    load_config,
    parse_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def demo():
    return yaml.safe_load((CONFIGS / "demo.yaml").read_text())


@pytest.mark.parametrize("name", ["demo.yaml", "nemo_gpt3_5b.yaml", "maxtext_per_device.yaml"])
def test_example_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.total_samples > 0


def test_rampup_forms():
    nemo = load_config(CONFIGS / "nemo_gpt3_5b.yaml")
    assert nemo.batch.rampup == MegatronRampup(start=256, increment=256, samples=10_000_000)
    assert nemo.total_samples == 300_000_000_000 // 2048
    maxtext = load_config(CONFIGS / "maxtext_per_device.yaml")
    assert isinstance(maxtext.batch.rampup, MaxTextRampup)
    assert maxtext.batch.rampup.samples == 200_000


def test_round_trip_through_json_keeps_the_rampup_form():
    config = load_config(CONFIGS / "maxtext_per_device.yaml")
    assert parse_config(config.model_dump(mode="json")) == config


def test_expansion_factor_may_be_spelled_under_batch():
    data = demo()
    del data["data"]["expansion_factor_real_data"]
    data["batch"]["expansion_factor_real_data"] = 2
    assert parse_config(data).data.expansion_factor_real_data == 2
    data["data"]["expansion_factor_real_data"] = 2
    assert parse_config(data).data.expansion_factor_real_data == 2
    data["data"]["expansion_factor_real_data"] = 3
    with pytest.raises(ConfigError, match="disagree"):
        parse_config(data)


def mutate(path, value):
    data = demo()
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


INVALID = [
    ("batch.global_batch_size", 0, "batch.global_batch_size: Input should be greater than 0"),
    ("batch.global_batch_size", -64, "batch.global_batch_size: Input should be greater than 0"),
    ("batch.global_batch_size", "lots", "batch.global_batch_size: Input should be a valid integer"),
    ("batch.micro_batch_size", "auto", "batch.micro_batch_size"),
    ("batch.rampup", {"start": 16, "increment": 0, "samples": 4096}, "batch.rampup.increment"),
    (
        "batch.rampup",
        {"start": 16, "increment": 16, "samples": "4X"},
        "batch.rampup.samples: '4X' is not a count",
    ),
    ("batch.rampup", [16, 16], "batch.rampup: the list form is [start, increment, samples]"),
    ("batch.rampup", {"start": 16, "incr": 16, "samples": 4096}, "batch.rampup: unknown key 'incr'"),
    ("batch.schedule", "0:16 1K:64", "batch: set either rampup or schedule, not both"),
    ("batch.surprise", 1, "batch: unknown key 'surprise'; valid keys are: global_batch_size"),
    ("cluster.backend", "slurm", "cluster.backend: Input should be 'local' or 'gke'"),
    ("cluster.min_nodes", 3, "cluster: min_nodes (3) must not exceed max_nodes (2)"),
    ("cluster.max_nodes", KeyError, "cluster.max_nodes: Field required"),
    ("data.uri", "s3://bucket/x", "data: uri 's3://bucket/x' must start with file:// or gs://"),
    ("data.seq_len", 1.5, "data.seq_len: Input should be a valid integer"),
    ("data.expansion_factor_real_data", 0, "data.expansion_factor_real_data: Input should be greater than 0"),
    (
        "data.expansion_factor_real_data",
        1.5,
        "data.expansion_factor_real_data: 1.5 is not a whole number: with a factor above 1 each loading host",
    ),
    ("train.total_tokens", 1000, "train: set exactly one of total_samples and total_tokens"),
    ("train.lr_scaling", "cubic", "train.lr_scaling: Input should be 'none', 'linear' or 'sqrt'"),
    ("train.min_lr_ratio", 2, "train.min_lr_ratio: Input should be less than or equal to 1"),
    (
        "explore.memory_budget_bytes",
        "2 GB of RAM",
        "explore.memory_budget_bytes: '2 GB of RAM' is not a byte size",
    ),
    (
        "explore.activation_checkpointing",
        [],
        "explore.activation_checkpointing: List should have at least 1 item",
    ),
    ("name", "Demo Run", "name: String should match pattern"),
    ("model.factory", "not a path", "model.factory: String should match pattern"),
]


@pytest.mark.parametrize(("path", "value", "expected"), INVALID, ids=[f"{p}={v}" for p, v, _ in INVALID])
def test_invalid_configs_name_the_field(path, value, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(mutate(path, value))
    assert any(line.startswith(expected) for line in info.value.lines), info.value.lines


def test_unknown_top_level_section():
    data = demo()
    data["optimiser"] = {}
    with pytest.raises(ConfigError, match="config: unknown key 'optimiser'"):
        parse_config(data)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_schema_forbids_unknown_keys_and_documents_fields():
    schema = config_schema()
    assert schema["additionalProperties"] is False
    batch = schema["$defs"]["BatchConfig"]
    assert batch["additionalProperties"] is False
    assert "target global batch size" in batch["properties"]["global_batch_size"]["description"]


def test_configs_are_frozen():
    config = parse_config(copy.deepcopy(demo()))
    with pytest.raises(ValueError):
        config.batch.global_batch_size = 1  # type: ignore[misc]


def test_checkpoints_by_time_every_30_minutes_by_default_and_0_turns_them_off():
    data = copy.deepcopy(demo())
    data["train"].pop("checkpoint_every_s", None)
    assert parse_config(data).train.checkpoint_every_s == 1800
    data["train"]["checkpoint_every_s"] = 0
    assert parse_config(data).train.checkpoint_every_s == 0
    data["train"]["checkpoint_every_s"] = -1
    with pytest.raises(ConfigError, match=r"train\.checkpoint_every_s"):
        parse_config(data)


def test_the_rl_section_is_gone():
    """It was validated and then drove nothing (#13): a config with it is refused, naming the valid keys."""
    from batchpilot.config import ConfigError, parse_config

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())
    data["rl"] = {"batch_size": 8, "num_generations": 4}
    with pytest.raises(ConfigError, match="unknown key 'rl'"):
        parse_config(data)


def test_loading_factors_the_trainer_accepts_load():
    """Whole factors above 1 and any factor up to 1 (every host reads; below 1 shrinks the batch to load)."""
    for factor in (0.5, 1, 2, 4.0):
        assert (
            parse_config(mutate("data.expansion_factor_real_data", factor)).data.expansion_factor_real_data
            == factor
        )
