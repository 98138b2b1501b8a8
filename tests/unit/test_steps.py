"""The pipeline steps' own checks (the components only call these)."""

import json

import pytest
import yaml

from batchpilot.errors import BatchpilotError
from batchpilot.steps import config_from_yaml, plan_step
from helpers import REPO

DEMO = (REPO / "configs" / "demo.yaml").read_text()


def test_run_time_overrides():
    config = config_from_yaml(DEMO, micro_batch_size=8, total_samples=8192)
    assert config.batch.micro_batch_size == 8 and config.total_samples == 8192
    assert config_from_yaml(DEMO).batch.micro_batch_size == "explore"
    as_json = json.dumps(yaml.safe_load(DEMO))  # the compiled default is one line of JSON
    assert config_from_yaml(as_json) == config_from_yaml(DEMO)


def test_plan_uses_the_explored_micro_batch(tmp_path):
    explore = tmp_path / "explore.json"
    explore.write_text(json.dumps({"recommendation": {"micro_batch_size": 16}}))
    document = json.loads(
        plan_step(
            config_yaml=DEMO,
            micro_batch_size=0,
            total_samples=0,
            explore_json=str(explore),
            expected_num_stages=4,
        )
    )
    assert document["micro_batch_size"] == 16
    assert [s["num_nodes"] for s in document["stages"]] == [1, 1, 1, 2]
    overridden = json.loads(
        plan_step(
            config_yaml=DEMO,
            micro_batch_size=8,
            total_samples=0,
            explore_json=str(explore),
            expected_num_stages=4,
        )
    )
    assert overridden["micro_batch_size"] == 8


def test_a_config_with_another_stage_count_asks_for_a_recompile(tmp_path):
    explore = tmp_path / "explore.json"
    explore.write_text(json.dumps({"recommendation": {"micro_batch_size": 16}}))
    longer_ramp = DEMO.replace("increment: 16", "increment: 8")
    with pytest.raises(
        BatchpilotError, match=r"implies 7 stage\(s\) but this pipeline was compiled for 4"
    ) as info:
        plan_step(
            config_yaml=longer_ramp,
            micro_batch_size=8,
            total_samples=0,
            explore_json=str(explore),
            expected_num_stages=4,
        )
    assert "python pipelines/compile.py" in str(info.value)
