"""The next launch's nodes asked for while the current launch trains (cluster.capacity_ahead): the timing
(planning/ahead.py) and the pool step that follows a launch (workflow/ahead.py) on a local pool whose resize
takes time (cluster.local_resize_delay_s)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from batchpilot import runstate
from batchpilot.cluster.nodepool import node_pool_for
from batchpilot.config import parse_config
from batchpilot.plan.planner import make_run_document
from batchpilot.planning.ahead import (
    LEAD_MARGIN,
    Lead,
    Progress,
    nodes_to_ask,
    remaining_s,
    resize_lead,
    seconds_until_ask,
)
from batchpilot.workflow import ahead
from batchpilot.workflow.ahead import ahead_unavailable, bring_next_nodes
from helpers import REPO, gke_a3_config, tiny_config, write_manifest


def test_the_lead_is_the_longest_resize_up_measured_else_the_configured_bound():
    events = [
        {"kind": "pool", "before": 0, "after": 2, "requested_s": 0.0, "ready_s": 40.0},
        {"kind": "pool", "before": 2, "after": 1, "requested_s": 50.0, "ready_s": 200.0},  # down: not a lead
        {"kind": "pool", "before": 1, "after": 3, "requested_s": 300.0, "ready_s": 390.0},
        {"kind": "launch", "launch": "x", "submitted_s": 0.0, "ended_s": 500.0},
    ]
    lead = resize_lead(events, configured_s=600)
    assert lead.seconds == 90 and "2 resize(s) up measured" in lead.source
    assert resize_lead(events[1:2], configured_s=600) == Lead(
        600.0, lead_source := resize_lead([], configured_s=600).source
    )
    assert "cluster.resize_lead_s" in lead_source


def test_the_nodes_are_asked_for_a_margin_over_the_lead_before_the_launch_ends():
    progress = Progress(consumed=1000, at_s=100.0, samples_per_s=10.0)
    # at 110 s, 1,100 samples are done: 900 left = 90 s
    assert remaining_s(progress, end_sample=2000, now_s=110.0) == pytest.approx(90)
    assert seconds_until_ask(
        progress, end_sample=2000, now_s=110.0, lead=Lead(40, ""), poll_s=10
    ) == pytest.approx(90 - LEAD_MARGIN * 40 - 10)
    assert seconds_until_ask(progress, end_sample=2000, now_s=110.0, lead=Lead(70, ""), poll_s=10) < 0  # now
    # a lead of 0 (a local pool): still one poll before the end, not at it
    assert seconds_until_ask(progress, end_sample=2000, now_s=110.0, lead=Lead(0, ""), poll_s=10) == 80
    assert (
        remaining_s(progress, end_sample=2000, now_s=500.0) == 0
    )  # past the end: nothing left, not negative


def test_a_pool_is_never_shrunk_early():
    assert nodes_to_ask(current_nodes=2, next_nodes=4) == 4
    assert nodes_to_ask(current_nodes=2, next_nodes=2) is None
    assert nodes_to_ask(current_nodes=4, next_nodes=2) is None
    assert nodes_to_ask(current_nodes=2, next_nodes=None) is None


def test_where_nodes_come_some_other_way_nothing_is_asked_ahead():
    def why(**cluster):
        return ahead_unavailable(parse_config(gke_a3_config(**cluster)))

    assert why() is None
    assert why(provisioning="flex-start") is None  # the next launch's request is queued ahead
    assert "autoscaled pool" in why(pool_mode="autoscale")
    assert "capacity_ahead is off" in why(capacity_ahead="off")
    tpu = yaml.safe_load((REPO / "src" / "batchpilot" / "configs" / "llama_5b_tpu.yaml").read_text())
    assert "tpu_slice_change is delete-first" in (ahead_unavailable(parse_config(tpu)) or "")
    tpu["cluster"]["tpu_slice_change"] = "create-first"  # the next slice may stand beside the current one
    assert ahead_unavailable(parse_config(tpu)) is None


def test_a_flex_start_request_is_queued_no_earlier_than_its_booking_can_be_held():
    from batchpilot.planning.ahead import BOOKING_MARGIN_S, FLEX_START_BOOKING_S, flex_start_seconds_until_ask

    progress = Progress(consumed=0, at_s=0.0, samples_per_s=1.0)
    # 3,600 s left: queue it when 600 - 120 = 480 s are left, i.e. in 3,120 s
    assert (
        flex_start_seconds_until_ask(progress, end_sample=3600, now_s=0.0)
        == pytest.approx(3600 - (FLEX_START_BOOKING_S - BOOKING_MARGIN_S))
        == pytest.approx(3120)
    )
    assert flex_start_seconds_until_ask(progress, end_sample=400, now_s=0.0) < 0  # less left: at once


@pytest.fixture
def document(tmp_path):
    """The tiny config's plan (stage-0 on 1 node, then 2 nodes) on a local pool whose resize up takes 3 s."""
    config = tiny_config(
        data_uri=write_manifest(tmp_path / "data"),
        checkpoint_uri=f"file://{tmp_path}/ckpt",
        cluster__pool_state_path=str(tmp_path / "pool.json"),
        cluster__local_resize_delay_s=3.0,
        cluster__resize_lead_s=5.0,
    )
    document = make_run_document(parse_config(config))
    node_pool_for(document.config).resize(1)  # launch-0's nodes, as its resize task left them
    return document


def pool_size(tmp_path: Path) -> int:
    return json.loads((tmp_path / "pool.json").read_text())["num_nodes"]


def test_the_pool_grows_for_the_next_launch_when_the_remaining_time_reaches_the_lead(
    document, tmp_path, monkeypatch
):
    monkeypatch.setattr(ahead, "POLL_S", 0.2)
    monkeypatch.setattr(ahead, "END_POLL_S", 0.1)
    uri = document.config.train.checkpoint_uri
    end = document.plan.stages[0].end_sample  # launch-0 is stage-0 alone
    rate = 40.0
    started = time.time()

    def train():  # the trainer's progress: at 40 samples/s, from `end - 40 * 8` (8 s left at the start)
        while (now := time.time()) - started < 8:
            done = end - 320 + int((now - started) * rate)
            runstate.write_progress(
                uri, stages=[0, 0], progress={"consumed": done, "at_s": now, "samples_per_s": rate}
            )
            time.sleep(0.2)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    said = bring_next_nodes(document, launch_index=0, poll_s=0.2)
    asked_after = time.time() - started
    trainer.join()
    assert "the pool grew 1 -> 2 node(s) for" in said
    assert pool_size(tmp_path) == 2
    # asked LEAD_MARGIN x 5 s (no resize measured: resize_lead_s) + a poll before the end at 8 s, ready 3 s later
    assert 8 - LEAD_MARGIN * 5 - 0.2 - 1.0 <= asked_after - 3.0 <= 8 - LEAD_MARGIN * 5 - 0.2 + 1.0
    grown = [e for e in runstate.read_events(uri, kind="pool") if e.get("early")]
    assert len(grown) == 1 and (grown[0]["before"], grown[0]["after"]) == (1, 2)
    assert grown[0]["ready_s"] - grown[0]["requested_s"] == pytest.approx(3.0, abs=0.5)


def test_a_launch_that_ends_first_ends_the_step_without_a_resize(document, tmp_path, monkeypatch):
    monkeypatch.setattr(ahead, "END_POLL_S", 0.1)
    uri = document.config.train.checkpoint_uri

    def end_launch():
        time.sleep(1.0)
        runstate.record_event(
            uri, {"kind": "launch", "launch": "stage-0", "stages": [0, 0], "submitted_s": time.time() - 1,
                  "ended_s": time.time(), "exit_code": 1, "nodes": 1},
        )  # fmt: skip

    threading.Thread(target=end_launch, daemon=True).start()
    started = time.monotonic()
    said = bring_next_nodes(document, launch_index=0, poll_s=0.2)
    assert "stage-0 ended (exit code 1) before its next launch's nodes were due" in said
    assert time.monotonic() - started < 5
    assert pool_size(tmp_path) == 1


def test_the_last_launch_and_a_launch_whose_successor_needs_no_more_nodes_ask_for_nothing(document, tmp_path):
    said = bring_next_nodes(document, launch_index=1)
    assert "nothing to ask for ahead (the last launch" in said
    assert pool_size(tmp_path) == 1


def test_a_train_task_logs_its_launchs_share_of_the_goodput_ledger(document):
    """The train task's KFP metrics carry the launch's goodput (its training-step node-hours over its paid
    ones), from the ledger's events (workflow.stage.launch_goodput)."""
    from batchpilot.planning.launches import launches
    from batchpilot.workflow.stage import launch_goodput

    uri = document.config.train.checkpoint_uri
    launch = launches(document.plan)[0]
    assert launch_goodput(document, launch=launch) == {}  # nothing recorded yet
    for event in (
        {"kind": "pool", "before": 0, "after": 1, "requested_s": 0.0, "ready_s": 10.0},
        {"kind": "launch", "launch": launch.name, "stages": [0, 0], "submitted_s": 10.0, "ended_s": 110.0,
         "exit_code": 0, "nodes": 1},
        {"kind": "trainer", "stages": [0, 0], "started_s": 20.0, "first_step_s": 30.0, "last_step_s": 90.0},
    ):  # fmt: skip
        runstate.record_event(uri, event)
    figures = launch_goodput(document, launch=launch)
    assert figures["launch_wall_s"] == pytest.approx(100)
    assert figures["launch_node_hours"] == pytest.approx(100 / 3600)
    assert figures["launch_goodput"] == pytest.approx(60 / 100)
