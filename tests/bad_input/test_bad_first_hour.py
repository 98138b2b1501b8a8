"""Issue #34, the mistakes that passed: each is refused by `config check` and `plan` in one line naming the
key and the fix, before anything runs; each has a valid twin that passes, so no check is vacuous. Any
number a YAML can hold (10^12) is answered at once: no planning path walks such a number one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from harness import no_debris, run_cli

from helpers import gke_a3_config, tiny_config, write_manifest


def gke(**cluster: object) -> dict:
    """The tiny model on a GKE pool of a3-highgpu-8g nodes, `cluster` settings replaced."""
    config = gke_a3_config()
    config["cluster"].update(cluster)
    return config


def write(folder: Path, config: dict, name: str = "config.yaml") -> str:
    path = folder / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def local(folder: Path, **overrides: object) -> dict:
    """The tiny local config on a manifest of 10M tokens (`section__key` overrides)."""
    return tiny_config(
        data_uri=write_manifest(folder / "data"), checkpoint_uri=f"file://{folder}/ckpt", **overrides
    )


def refused(folder: Path, config: dict, *fragments: str, command: str = "plan", alone: bool = True) -> str:
    """The config refused in one line with every fragment; `alone` False: the plan reports every problem of
    a config on its own line, one of which has every fragment. Nothing written either way."""
    path = write(folder, config)
    argv = ["plan", "--config", path, "--out", str(folder / "plan.json")] if command == "plan" else [
        "config", "check", path
    ]  # fmt: skip
    with no_debris(folder):
        outcome = run_cli(*argv)
    if alone:
        return outcome.assert_refused(*fragments)
    assert outcome.code == 2 and "Traceback" not in outcome.stderr, outcome.stderr
    lines = outcome.error_lines()
    assert lines and all(line.startswith("batchpilot: error: ") for line in lines), lines
    found = [line for line in lines if all(f.lower() in line.lower() for f in fragments)]
    assert found, (fragments, lines)
    return found[0]


def passes(folder: Path, config: dict) -> None:
    outcome = run_cli("config", "check", write(folder, config, "twin.yaml"))
    assert outcome.code == 0, outcome.stderr


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_a_sequence_longer_than_the_models_context(tmp_path: Path, command: str):
    config = local(tmp_path, data__seq_len=64)  # the tiny GPT's block_size is 32
    refused(
        tmp_path, config, "data.seq_len: is 64 tokens, but the model takes at most 32 (model.args.block_size)",
        "set data.seq_len to at most 32, or raise model.args.block_size to 64", command=command,
    )  # fmt: skip
    passes(tmp_path, local(tmp_path, data__seq_len=32))


def test_an_accelerator_type_gke_does_not_have_names_the_nearest(tmp_path: Path):
    config = gke(accelerator_type="nvidia-h100")
    line = refused(tmp_path, config, "cluster.accelerator_type: 'nvidia-h100' is not a GPU batchpilot knows")
    assert "nearest: nvidia-h100-80gb" in line and "cluster.device_memory_bytes" in line
    passes(tmp_path, gke())
    passes(tmp_path, gke(accelerator_type="nvidia-b200", device_memory_bytes=192 * 2**30, machine_type=None))


def test_a_machine_type_batchpilot_cannot_size_names_the_nearest(tmp_path: Path):
    config = gke(machine_type="a3-highgpu-8")
    line = refused(
        tmp_path, config, "cluster.machine_type: 'a3-highgpu-8' is not a machine type batchpilot knows"
    )
    assert "nearest: a3-highgpu-8g" in line and "cluster.cpu_per_node" in line
    # A CPU pool of any Compute Engine type passes (its pods are sized from the ready nodes); a name no
    # machine type has does not.
    cpu_pool = gke(machine_type="e2-standard-4", accelerator_type=None, devices_per_node=1)
    passes(tmp_path, cpu_pool)
    refused(
        tmp_path,
        gke(machine_type="bogus", accelerator_type=None, devices_per_node=1),
        "'bogus' is not a machine type",
    )
    sized = gke(machine_type="a4-highgpu-8g", cpu_per_node=200, memory_per_node_bytes=1800 * 2**30)
    out = tmp_path / "twin"
    out.mkdir()
    assert run_cli("plan", "--config", write(out, sized)).code == 0


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path):
    text = yaml.safe_dump(local(tmp_path), sort_keys=False)
    path = tmp_path / "config.yaml"
    path.write_text(text + "train:\n  lr: 0.5\n  total_samples: 2048\n  checkpoint_uri: file://x\n")
    with no_debris(tmp_path):
        outcome = run_cli("config", "check", str(path))
    line = outcome.assert_refused("config: the key 'train' is given twice in one mapping (lines")
    assert "merge them into one" in line
    passes(tmp_path, local(tmp_path))


def test_an_empty_config_file_says_it_is_empty(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text("# nothing yet\n")
    outcome = run_cli("config", "check", str(path))
    line = outcome.assert_refused(f"config: {path} is empty", "configs/demo.yaml")
    assert "NoneType" not in line


def test_a_warmup_longer_than_the_run(tmp_path: Path):
    refused(
        tmp_path, local(tmp_path, train__warmup_samples=4096),
        "train.warmup_samples: is 4,096, longer than the run (train.total_samples: 2,048 samples)",
    )  # fmt: skip
    passes(tmp_path, local(tmp_path, train__warmup_samples=2048))


def test_a_data_set_smaller_than_one_global_batch(tmp_path: Path):
    config = local(tmp_path)
    config["data"]["uri"] = write_manifest(tmp_path / "small", num_tokens=32 * 63 + 1)  # 63 samples of 32
    refused(
        tmp_path, config, "data.uri", "holds 63 samples of 32 tokens in its train split",
        "fewer than one global batch of 64",
    )  # fmt: skip
    config["data"]["uri"] = write_manifest(tmp_path / "enough", num_tokens=32 * 64 + 1)
    passes(tmp_path, config)


def test_a_batch_size_that_looks_like_a_token_count(tmp_path: Path):
    config = local(tmp_path, data__seq_len=32)
    config["batch"].update(global_batch_size=4_194_304 * 2, schedule=None)
    line = refused(
        tmp_path, config, "batch.global_batch_size: is 8,388,608 samples of 32 tokens", alone=False
    )
    assert "looks like a token count, but batch sizes count samples" in line
    assert "8,388,608 tokens are 262,144 samples of 32" in line
    twin = local(tmp_path)
    twin["batch"].update(global_batch_size=2048, schedule=None)
    twin["train"]["total_samples"] = 4096
    passes(tmp_path, twin)


def test_a_target_batch_larger_than_the_whole_run(tmp_path: Path):
    config = local(tmp_path)
    config["batch"].update(global_batch_size=4096, schedule=None)
    refused(
        tmp_path,
        config,
        "train.total_samples: 2,048 samples are fewer than one step of the global batch 4,096",
    )


# --- any number a YAML can hold, answered at once ---------------------------------------------------------

TERA = 10**12


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"batch": {"global_batch_size": TERA, "schedule": None}}, "batch.global_batch_size"),
        ({"batch": {"global_batch_size": TERA, "schedule": None, "rampup": [16, 16, 1024]}}, "batch."),
        ({"batch": {"global_batch_size": TERA, "schedule": f"0:16 1024:{TERA}"}}, "batch."),
        ({"batch": {"global_batch_size": "auto", "max_global_batch_size": TERA, "schedule": None}}, "batch."),
        ({"batch": {"micro_batch_size": TERA}}, "batch.micro_batch_size"),
        ({"batch": {"micro_batch_size": TERA - 1}}, "batch.micro_batch_size"),
        ({"cluster": {"max_nodes": TERA}}, "cluster.max_nodes"),
        ({"cluster": {"min_nodes": TERA}}, "cluster.min_nodes"),
        ({"cluster": {"devices_per_node": TERA}}, "cluster.devices_per_node"),
        ({"train": {"warmup_samples": TERA}}, "train.warmup_samples"),
        ({"data": {"seq_len": TERA}}, "data.seq_len"),
        ({"train": {"tensor_parallel_size": TERA}}, "train.tensor_parallel_size"),
    ],
    ids=[
        "global-batch", "megatron-ramp", "schedule", "auto-bound", "micro-batch", "odd-micro-batch",
        "max-nodes", "min-nodes", "devices", "warmup", "seq-len", "tensor-parallel",
    ],
)  # fmt: skip
def test_a_number_as_large_as_a_yaml_holds_is_refused_at_once(tmp_path: Path, change: dict, fragment: str):
    config = local(tmp_path)
    for section, values in change.items():
        if "rampup" in values:
            values = {
                **values,
                "rampup": dict(zip(("start", "increment", "samples"), values["rampup"], strict=True)),
            }
        config[section].update(values)
    refused(tmp_path, config, fragment, alone=False)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "total", [{"total_samples": TERA}, {"total_samples": None, "total_tokens": TERA * TERA}]
)
def test_a_total_as_large_as_a_yaml_holds_plans_at_once(tmp_path: Path, total: dict):
    config = local(tmp_path)
    config["train"].update(total)
    outcome = run_cli("plan", "--config", write(tmp_path, config), "--samples-per-s-per-device", "1000")
    assert outcome.code == 0, outcome.stderr
