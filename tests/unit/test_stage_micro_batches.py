"""Each stage on the fastest micro batch explore measured that splits its batch (#36 item 4): a later stage on
more data-parallel ranks may take a size the first stage's batch does not split into."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from batchpilot.cli import main
from batchpilot.planning.stages import Plan, faster_micro_batches
from helpers import synthetic_explore_json, tiny_config, write_manifest


def config_path(tmp_path: Path) -> str:
    config = tiny_config(data_uri=write_manifest(tmp_path / "data"), checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["cluster"]["devices_per_node"] = 2
    config["batch"].update(micro_batch_size="explore", global_batch_size=96, schedule="0:24 480:48 960:96")
    config["explore"] = {"study": False}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_final_stage_trains_at_8_where_its_batch_splits_into_it(tmp_path, capsys):
    assert (
        main(
            [
                "plan",
                "--config",
                config_path(tmp_path),
                "--explore",
                synthetic_explore_json(tmp_path),
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["micro_batch_size"] == 4
    rows = [(s["global_batch_size"], s["data_parallel_size"], s["micro_batch_size"]) for s in plan["stages"]]
    # 24 over 2 ranks and 48 over 4 split into 4 but not 8 or 16; 96 over 4 splits into 8 (1.13x 4), not 16.
    assert rows == [(24, 2, 4), (48, 4, 4), (96, 4, 8)]
    assert [s["gradient_accumulation_steps"] for s in plan["stages"]] == [3, 3, 3]
    memory = {item["stage"]: item for item in plan["memory"]["stages"]}
    assert memory["final"]["activations_bytes"] > memory["stage-1"]["activations_bytes"]
    assert (
        main(["plan", "--config", config_path(tmp_path), "--explore", synthetic_explore_json(tmp_path)]) == 0
    )
    captured = capsys.readouterr()
    assert "final at 8 (1.13x) the plan's micro_batch_size 4" in captured.out + captured.err


def test_a_size_within_the_noise_or_that_does_not_fit_is_not_taken(tmp_path, capsys):
    config = yaml.safe_load(Path(config_path(tmp_path)).read_text())
    config["batch"]["micro_batch_size"] = 4
    (tmp_path / "fixed.yaml").write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(tmp_path / "fixed.yaml"), "--json"]) == 0
    stages = Plan.from_dict(json.loads(capsys.readouterr().out)).stages
    near = {4: 1.0, 8: 1.02}  # 2% faster: within explore's noise
    assert faster_micro_batches(stages, speeds=near, base=4, fits=lambda s, m: True) == stages
    far = {4: 1.0, 8: 1.2}
    assert faster_micro_batches(stages, speeds=far, base=4, fits=lambda s, m: False) == stages
    final = faster_micro_batches(stages, speeds=far, base=4, fits=lambda s, m: True)[-1]
    assert (final.micro_batch_size, final.gradient_accumulation_steps) == (8, 3)
