"""Issue #13: what no micro batch can fix is refused by `config check`, `plan` and `compile` alike, with
one line per problem, exit 2 and nothing written."""

import json
from pathlib import Path

import pytest
import yaml

from batchpilot.cli import main

NEMO = Path(__file__).resolve().parents[2] / "configs" / "nemo_gpt3_5b.yaml"


def nemo(*, micro_batch_size="explore", data=None, **batch):
    config = yaml.safe_load(NEMO.read_text())
    config["batch"]["micro_batch_size"] = micro_batch_size
    if "schedule" in batch:
        del config["batch"]["rampup"]
    config["batch"].update(batch)
    config["data"].update(data or {})
    return config


# (the config, every line `batchpilot: error: ` prints for it)
BAD_CONFIGS = {
    "start above target": (
        nemo(rampup=[4096, 256, "10M"]),
        [
            "batch.rampup: start (4096) must be smaller than the target global batch size (2048) "
            "(fix: rampup: [1792, 256, 10M], or remove the ramp-up)"
        ],
    ),
    "decreasing schedule": (
        nemo(schedule="0:512 1M:256 2M:2048"),
        [
            "batch.schedule: '1M:256' must come after '0:512' with a larger threshold and batch (fix: list "
            'thresholds and batch sizes in increasing order, e.g. schedule: "0:256 1M:512 2M:2048")'
        ],
    ),
    "unparsable schedule": (
        nemo(schedule="0:256 5X:512 1M:1O24 2M:2048"),
        [
            "batch.schedule (5X:512): '5X' is not a count (fix: write a number with an optional K, M, B or T "
            "suffix, e.g. 10M)",
            "batch.schedule (1M:1O24): '1O24' is not a count (fix: write a number with an optional K, M, B or "
            "T suffix, e.g. 10M)",
        ],
    ),
    "ramp no micro batch can place": (
        nemo(rampup=[100, 4, "10M"]),
        [
            "batch.rampup: 244 of its 488 stages fit no micro batch on 1-16 nodes of 8 device(s), not even "
            "micro_batch_size 1: stage 0 (100), stage 2 (108), stage 4 (116), stage 6 (124), stage 8 (132), "
            "stage 10 (140), stage 12 (148), stage 14 (156) and 236 more (fix: rampup: [96, 32, 10M])",
            "batch.rampup: makes 488 stages, more than 64 (each stage resizes the node pool, launches the job "
            "and writes a checkpoint) (fix: rampup: [96, 32, 10M])",
        ],
    ),
    "schedule no micro batch can place": (
        nemo(schedule="0:100 1M:520 3M:2048"),
        [
            "batch.schedule: 1 of its 3 stages fit no micro batch on 1-16 nodes of 8 device(s), not even "
            'micro_batch_size 1: stage 0 (100) (fix: schedule: "0:104 1M:520 3M:2048")'
        ],
    ),
    "too many stages": (
        nemo(rampup=[16, 16, "10M"]),
        [
            "batch.rampup: makes 128 stages, more than 64 (each stage resizes the node pool, launches the job "
            "and writes a checkpoint) (fix: rampup: [32, 32, 10M])"
        ],
    ),
    "fractional loading factor": (
        nemo(data={"expansion_factor_real_data": 1.5}),
        [
            "data.expansion_factor_real_data: 1.5 is not a whole number: with a factor above 1 each loading "
            "host reads for itself and f - 1 whole other hosts, and the trainer refuses it at start-up; use 2 "
            "(node counts are then multiples of it) or 1 (got 1.5)"
        ],
    ),
    "loading factor no node count takes": (
        nemo(data={"expansion_factor_real_data": 32}),
        [
            "data.expansion_factor_real_data: 32 divides no node count in [1, 16] (cluster.min_nodes, "
            "max_nodes), and the trainer needs every node count to be a whole number of loading groups "
            "(fix: use 1 or a factor that divides cluster.max_nodes (16))"
        ],
    ),
}

TPU = Path(__file__).resolve().parents[2] / "configs" / "llama_5b_tpu.yaml"


def changed(path: Path, **sections: dict) -> dict:
    """The example config at `path` with some keys of its sections replaced."""
    config = yaml.safe_load(path.read_text())
    for section, values in sections.items():
        config[section].update(values)
    return config


# Issue #20: what a gke cluster would refuse only after the pool was scaled up.
BAD_CONFIGS |= {
    "gke with local checkpoints and data": (
        changed(
            NEMO, data={"uri": "file:///data/gpt3"}, train={"checkpoint_uri": "file://runs/gpt3-5b/ckpt"}
        ),
        [
            "train.checkpoint_uri: file://runs/gpt3-5b/ckpt is a local path, but each gke trainer pod would write "
            "it into its own emptyDir: a restarted JobSet would start again from step 0 and the train task could "
            "not read the metrics (fix: use a gs:// URI the pods' service account can write, e.g. "
            "gs://BUCKET/gpt3-5b/ckpt)",
            "data.uri: file:///data/gpt3 is a local path, which gke trainer pods cannot read (they see their image "
            "and an empty /tmp) (fix: copy the shard set to GCS (`batchpilot data prepare ... --out "
            "gs://BUCKET/PREFIX`) and use its gs:// URI)",
        ],
    ),
    "names gke refuses": (
        changed(NEMO, cluster={"node_pool": "H100_pool", "namespace": "ML", "kueue_queue": "-lm"}),
        [
            "cluster.namespace: 'ML' is not a Kubernetes namespace name (a DNS-1123 label: at most 63 lower case "
            "letters, digits and '-', a letter or digit at both ends) (fix: use an existing namespace's name, "
            "e.g. batchpilot)",
            "cluster.kueue_queue: '-lm' cannot be the value of the kueue.x-k8s.io/queue-name label (at most 63 "
            "letters, digits, '-', '_' or '.', a letter or digit at both ends) (fix: use the name of a "
            "LocalQueue in cluster.namespace)",
            "cluster.node_pool: 'H100_pool' is not a node pool name: GKE node pool names are 1-40 lower case "
            "letters, digits and '-', starting with a letter and not ending with '-'",
        ],
    ),
    "TPU slice pool names too long": (
        changed(TPU, cluster={"node_pool": "trillium-v6e-training-pool-us-east5-b"}),
        [
            "cluster.node_pool: 'trillium-v6e-training-pool-us-east5-b' makes TPU slice node pool names GKE "
            "refuses (trillium-v6e-training-pool-us-east5-b-2x4, trillium-v6e-training-pool-us-east5-b-4x4, "
            "trillium-v6e-training-pool-us-east5-b-4x8): GKE node pool names are 1-40 lower case letters, digits "
            "and '-', starting with a letter and not ending with '-' (fix: shorten cluster.node_pool to at most "
            "36 characters)"
        ],
    ),
}

COMMANDS = {
    "config check": lambda config, out: ["config", "check", config],
    "plan": lambda config, out: ["plan", "--config", config, "--out", out],
    "plan --micro-batch-size 4": lambda config, out: [
        "plan", "--config", config, "--micro-batch-size", "4", "--out", out,
    ],
    "compile": lambda config, out: ["compile", "--config", config, "--out", out],
}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_configs_are_refused_alike_one_line_per_problem(tmp_path, capsys, case, command):
    data, expected = BAD_CONFIGS[case]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "out.yaml"
    assert main(COMMANDS[command](str(config), str(out))) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"batchpilot: error: {line}" for line in expected]
    assert not out.exists()


def test_config_check_with_explore_counts_the_stages(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(nemo()))
    assert main(["config", "check", str(config)]) == 0
    assert "8 stage(s), each placeable at some micro batch" in capsys.readouterr().out


def test_loading_hosts_divide_every_stage_node_count(tmp_path, capsys):
    """Factor 4: every stage runs on a multiple of 4 nodes, a whole number of loading groups as the trainer
    requires; the walk skips 14 and 10 (today's choice for 1792 and 1280) and 12 does not split 1792."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(nemo(micro_batch_size=4, data={"expansion_factor_real_data": 4})))
    assert main(["plan", "--config", str(config), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["num_nodes"] for s in stages] == [8, 8, 8, 8, 8, 8, 8, 16]
    assert [s["num_loading_hosts"] for s in stages] == [2] * 7 + [4]


@pytest.mark.parametrize("name", ["my-llama-5b-pretraining", "5b-llama", "a" * 40])
def test_run_names_the_jobset_webhook_refused_before_now_pass_config_check(tmp_path, capsys, name):
    """(#20) The run's name no longer becomes the JobSet's name verbatim (tests/integration/
    test_jobset_names_sim.py runs the launches' JobSets through the webhook's rules)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(yaml.safe_load(NEMO.read_text()) | {"name": name}))
    assert main(["config", "check", str(config)]) == 0, capsys.readouterr().err
