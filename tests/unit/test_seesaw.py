"""Seesaw (issue #38; Meterez et al., arXiv 2510.14717): where a step-decay schedule would divide the LR by a
factor, the batch grows by the factor and the LR falls by its square root; the node schedule follows."""

from __future__ import annotations

import json
import math

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.planning import seesaw_rampup
from helpers import tiny_config, write_plan


def seesaw_config(data_uri: str = "file:///tmp/data", **train: object) -> dict:
    """The tiny model: 16 -> 32 at sample 320 -> 64 at 960, as a seesaw with factor 2, constant LR."""
    config = tiny_config(data_uri=data_uri, checkpoint_uri="file:///tmp/ckpt")
    del config["batch"]["schedule"]
    config["batch"]["rampup"] = {"seesaw": {"start": 16, "factor": 2, "cuts": [320, 960]}}
    config["train"].update({"lr_decay": "constant", **train})
    return config


def test_the_batch_grows_by_the_factor_at_each_cut_to_the_target():
    schedule = seesaw_rampup(start=16, factor=2, cuts=[320, 960], target=64)
    assert (schedule.thresholds, schedule.batch_sizes) == ((0, 320, 960), (16, 32, 64))
    # once the batch is the target, the later cuts are the LR's (a step decay's)
    assert seesaw_rampup(start=16, factor=2, cuts=[320, 960, 1500], target=64).batch_sizes == (16, 32, 64)
    with pytest.raises(BatchpilotError, match=r"grows the batch from 16 by 2 at each cut \(16, 32, 64 with 2 "
                       r"cut\(s\)\), which never reaches the target global_batch_size 128 \(fix: set "
                       r"batch.global_batch_size to one of 32, 64"):  # fmt: skip
        seesaw_rampup(start=16, factor=2, cuts=[320, 960], target=128)
    with pytest.raises(
        BatchpilotError, match=r"batch.rampup.seesaw.cuts: must be consumed-sample points in "
    ):
        seesaw_rampup(start=16, factor=4, cuts=[960, 320], target=256)


def test_a_seesaw_plan_lowers_the_lr_by_the_factors_square_root_where_the_batch_grows(
    tmp_path, demo_data_uri
):
    """The stages are the seesaw's batches on the nodes they need, and each stage's peak LR is lr / sqrt(batch /
    start): 1e-3, 1e-3 / sqrt 2, 1e-3 / 2; after the warmup the LR is constant within a stage."""
    from batchpilot.plan.rundoc import read_run_document

    document = read_run_document(write_plan(tmp_path, seesaw_config(demo_data_uri)))
    stages = document.plan.stages
    assert [(s.global_batch_size, s.start_sample, s.num_nodes) for s in stages] == [
        (16, 0, 1), (32, 320, 2), (64, 960, 2),
    ]  # fmt: skip
    assert [s.lr for s in stages] == pytest.approx([1e-3, 1e-3 / math.sqrt(2), 1e-3 / 2])
    schedule = document.plan.lr_schedule
    assert schedule.at(consumed_samples=200, global_batch_size=16) == pytest.approx(1e-3)
    assert schedule.at(consumed_samples=2000, global_batch_size=64) == pytest.approx(5e-4)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["lr_schedule"]["scaling"] == "seesaw" and saved["lr_schedule"]["reference_batch"] == 16


def test_the_cuts_after_the_target_divide_the_lr_by_the_factor(tmp_path, demo_data_uri):
    from batchpilot.plan.rundoc import read_run_document

    config = seesaw_config(demo_data_uri)
    config["batch"]["rampup"]["seesaw"]["cuts"] = [320, 960, 1536]  # the third: batch 64 is the target
    document = read_run_document(write_plan(tmp_path, config))
    assert [s.global_batch_size for s in document.plan.stages] == [16, 32, 64]
    schedule = document.plan.lr_schedule
    assert schedule.at(consumed_samples=1535, global_batch_size=64) == pytest.approx(5e-4)
    assert schedule.at(consumed_samples=1536, global_batch_size=64) == pytest.approx(2.5e-4)
    assert schedule.lr_cuts == (1536,)  # read back from plan.json


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (
            {"lr_decay": "cosine"},
            "train.lr_decay: is cosine, but batch.rampup.seesaw replaces the step decay",
        ),
        ({"lr_scaling": "sqrt"}, "train.lr_scaling: batch.rampup.seesaw sets the LR per stage itself"),
    ],
)
def test_a_seesaw_with_a_schedule_of_the_configs_own_is_refused(tmp_path, capsys, train, message):
    import yaml

    from batchpilot.cli import main

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(seesaw_config(**train)))
    assert main(["config", "check", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
