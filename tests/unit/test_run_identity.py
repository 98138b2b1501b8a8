"""A checkpoint continues only the run that wrote it (config/identity.py): another plan's checkpoint is
refused in one line naming the setting, a longer run and a trials branch continue and say so."""

from pathlib import Path

import pytest
import yaml

from batchpilot import runstate
from batchpilot.config import parse_config
from batchpilot.config.identity import checkpoint_continuation, continuation, run_id, run_identity, run_record
from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage
from batchpilot.train.checkpoint import Checkpoint
from batchpilot.train.setup import check_same_run
from helpers import REPO


def config(**sections):
    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for section, values in sections.items():
        raw[section].update(values)
    return parse_config(raw)


def test_the_same_config_continues_its_own_run():
    saved = run_record(config())
    assert continuation(config(), saved, where="file://c").how == "same"
    assert continuation(config(), saved, where="file://c").describe() == f"run {saved['id']}"


@pytest.mark.parametrize(
    ("sections", "key"),
    [
        ({"train": {"lr": 0.0001}}, "train.lr"),
        ({"train": {"seed": 2}}, "train.seed"),
        ({"train": {"warmup_samples": 7}}, "train.warmup_samples"),
        ({"train": {"weight_decay": 0.0}}, "train.weight_decay"),
        ({"batch": {"global_batch_size": 128}}, "batch.global_batch_size"),
        ({"batch": {"rampup": None, "schedule": "0:32"}}, "batch.rampup"),
        (
            {
                "model": {
                    "args": {"n_layer": 3, "n_head": 2, "n_embd": 64, "block_size": 128, "vocab_size": 257}
                }
            },
            "model.args",
        ),
        ({"data": {"seq_len": 64}}, "data.seq_len"),
    ],
)
def test_another_run_is_refused_naming_the_first_setting_that_differs(sections, key):
    saved = run_record(config())
    with pytest.raises(BatchpilotError) as caught:
        continuation(config(**sections), saved, where="file://ckpt")
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith(f"{key}: is ")
    assert f"but file://ckpt holds run {saved['id']}" in line
    assert "a checkpoint only continues the run that wrote it" in line
    assert "give this run its own train.checkpoint_uri" in line


def test_what_only_executes_the_run_differently_is_the_same_run():
    saved = run_record(config())
    other = config(
        batch={"micro_batch_size": 4},
        train={
            "parallelism": "fsdp",
            "checkpoint_every_steps": 3,
            "eval_every_samples": 0,
            "precision": "fp32",
        },
    )
    assert continuation(other, saved, where="file://c").how == "same"


def test_a_longer_run_continues_and_says_its_new_length():
    saved = run_record(config())
    total = config().total_samples
    longer = continuation(config(train={"total_samples": 2 * total}), saved, where="file://c")
    assert longer.how == "longer" and longer.run == saved["id"]
    assert f"train.total_samples {2 * total:,} (was {total:,})" in longer.describe()
    assert "the LR decay follows it from here" in longer.describe()


def test_the_run_id_leaves_the_length_out():
    assert run_id(run_identity(config())) == run_id(run_identity(config(train={"total_samples": 99_999})))
    assert run_id(run_identity(config())) != run_id(run_identity(config(train={"lr": 0.0001})))


def test_a_checkpoint_without_a_run_record_is_not_checked_and_says_so():
    assert "not checked" in continuation(config(), None, where="file://c").describe()


def test_a_trials_branch_continues_from_its_copied_checkpoint_only_at_the_copy(tmp_path: Path):
    warm = run_record(config())
    branch_config = config(batch={"global_batch_size": 128}, train={"lr": 0.002})
    meta = {"consumed_samples": 512, "run": warm}
    record = {"source": "file://w", "run": warm["id"], "consumed_samples": 512}
    found = checkpoint_continuation(branch_config, meta, branch=record, where="file://b")
    assert found.how == "branch" and "a trials branch from file://w at sample 512" in found.describe()
    with pytest.raises(
        BatchpilotError, match=r"batch\.global_batch_size: is 128"
    ):  # past the copy: its own run
        checkpoint_continuation(
            branch_config, {**meta, "consumed_samples": 640}, branch=record, where="file://b"
        )
    with pytest.raises(
        BatchpilotError, match=r"batch\.global_batch_size: is 128"
    ):  # another run's checkpoint
        checkpoint_continuation(
            branch_config, meta, branch={**record, "run": "0123abcd4567"}, where="file://b"
        )


def test_the_trainer_reads_the_branch_record_beside_the_checkpoint(tmp_path: Path):
    storage = LocalStorage(tmp_path)
    warm = run_record(config())
    branch_config = config(batch={"global_batch_size": 128})
    saved = Checkpoint(
        step=4, consumed_samples=512, rng={}, meta={"consumed_samples": 512, "run": warm}, folder="000000004",
        storage=storage,
    )  # fmt: skip
    with pytest.raises(BatchpilotError, match="a checkpoint only continues the run that wrote it"):
        check_same_run(branch_config, saved, uri="file://b")
    storage.write(
        runstate.BRANCH_OBJECT,
        f'{{"source": "file://w", "run": "{warm["id"]}", "consumed_samples": 512}}'.encode(),
    )
    assert "a trials branch from file://w" in (check_same_run(branch_config, saved, uri="file://b") or "")
    assert check_same_run(branch_config, None, uri="file://b") is None
