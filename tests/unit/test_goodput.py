"""The goodput ledger (planning/goodput.py) from a written-out timeline of events."""

from __future__ import annotations

import pytest

from batchpilot.planning.goodput import build_ledger, describe

# A run: explore's pool (0 -> 2 nodes, 10 s), explore and plan (until 100), launch-0 on 1 node (resize down
# 2 -> 1 at 100..102), its job 105..200 (process 120, first step 140, last step 190), resize up 1 -> 2
# (200..260), launch-1 265..400 (process 275, first 285, last 380), scale-down 2 -> 0 at 410..420.
EVENTS = [
    {"kind": "pool", "before": 0, "after": 2, "requested_s": 0.0, "ready_s": 10.0},
    {"kind": "pool", "before": 2, "after": 1, "requested_s": 100.0, "ready_s": 102.0},
    {"kind": "launch", "launch": "launch-0", "stages": [0, 0], "submitted_s": 105.0, "ended_s": 200.0, "exit_code": 0},
    {
        "kind": "trainer", "stages": [0, 0], "started_s": 120.0, "first_step_s": 140.0, "last_step_s": 190.0,
        "checkpoint_blocked_s": 2.0, "evaluation_s": 3.0, "data_wait_s": 0.5,
    },
    {"kind": "pool", "before": 1, "after": 2, "requested_s": 200.0, "ready_s": 260.0},
    {"kind": "launch", "launch": "launch-1", "stages": [1, 1], "submitted_s": 265.0, "ended_s": 400.0, "exit_code": 0},
    {
        "kind": "trainer", "stages": [1, 1], "started_s": 275.0, "first_step_s": 285.0, "last_step_s": 380.0,
        "checkpoint_blocked_s": 1.0, "evaluation_s": 0.0, "data_wait_s": 0.25,
    },
    {"kind": "pool", "before": 2, "after": 0, "requested_s": 410.0, "ready_s": 420.0},
]  # fmt: skip


def test_every_second_is_in_one_category_and_node_hours_follow_the_nodes_up():
    ledger = build_ledger(EVENTS, now_s=420.0)
    assert ledger is not None
    walls = {name: share.wall_s for name, share in ledger.categories.items()}
    assert walls == pytest.approx(
        {
            "waiting_for_nodes": 10 + 60,
            "pod_start": 15 + 10,
            "start_up": 20 + 10,
            "training_steps": 50 + 95,
            "tail": 10 + 20,
            "idle": 90 + 2 + 3 + 5 + 20,  # explore/plan, scale-down 100..102, 102..105, 260..265, 400..420
        }
    )
    assert sum(walls.values()) == pytest.approx(ledger.wall_s) == pytest.approx(420)
    # Training: launch-0's 50 s on 1 node, launch-1's 95 s on 2.
    assert ledger.categories["training_steps"].node_hours == pytest.approx((50 * 1 + 95 * 2) / 3600)
    # Nodes up: 0 until 10, 2 until 102, 1 until 260, 2 until 420 (0 after).
    paid = (92 * 2 + 158 * 1 + 160 * 2) / 3600
    assert ledger.node_hours == pytest.approx(paid)
    assert ledger.goodput == pytest.approx(((50 + 190) / 3600) / paid)
    assert ledger.launches["launch-1"]["training_steps"].wall_s == pytest.approx(95)
    assert (ledger.checkpoint_blocked_s, ledger.evaluation_s, ledger.data_wait_s) == (3.0, 3.0, 0.75)
    assert describe(ledger).startswith(f"goodput {ledger.goodput:.2f}: ")


def test_a_resize_while_training_is_training_and_a_launch_without_trainer_is_failed():
    early = [
        *EVENTS[:4],
        {"kind": "pool", "before": 1, "after": 2, "requested_s": 150.0, "ready_s": 180.0},  # ahead of time
        {
            "kind": "launch",
            "launch": "launch-1",
            "stages": [1, 1],
            "submitted_s": 205.0,
            "ended_s": 230.0,
            "exit_code": 1,
        },
    ]
    ledger = build_ledger(early, now_s=230.0)
    assert ledger is not None
    assert ledger.categories["training_steps"].wall_s == pytest.approx(50)
    assert ledger.categories["waiting_for_nodes"].wall_s == pytest.approx(10)  # explore's pool only
    assert ledger.categories["failed"].wall_s == pytest.approx(25)
    # the second node, ready at 180 while launch-0 trains on one, is paid: 1 node-second per second
    assert ledger.categories["training_steps"].node_hours == pytest.approx((40 * 1 + 10 * 2) / 3600)


def test_no_resize_no_ledger():
    assert build_ledger([], now_s=5.0) is None


def test_nodes_up_for_the_next_launch_beside_a_running_one_are_paid_early_capacity_not_training():
    """cluster.capacity_ahead grows the pool for launch-1 while launch-0 trains on 1 node: the second node, ready
    at 180, is paid and idle until launch-1 runs on it (early_capacity, node-hours only)."""
    launch_0 = {**EVENTS[2], "nodes": 1}
    early = [
        *EVENTS[:2],
        launch_0,
        EVENTS[3],
        {"kind": "pool", "before": 1, "after": 2, "requested_s": 150.0, "ready_s": 180.0, "early": True},
        {**EVENTS[5], "submitted_s": 205.0, "nodes": 2},
        {**EVENTS[6], "started_s": 215.0},
    ]
    ledger = build_ledger(early, now_s=400.0)
    assert ledger is not None
    assert ledger.categories["training_steps"].node_hours == pytest.approx((50 * 1 + 95 * 2) / 3600)
    # 180..200 on launch-0 (training 10 s, tail 10 s) and 200..205 between launches (idle: no launch runs)
    assert ledger.categories["early_capacity"].node_hours == pytest.approx(20 / 3600)
    assert ledger.categories["early_capacity"].wall_s == 0
    assert ledger.launches["launch-0"]["early_capacity"].node_hours == pytest.approx(20 / 3600)
    assert ledger.categories["idle"].node_hours == pytest.approx((90 * 2 + 2 * 2 + 3 * 1 + 5 * 2) / 3600)
    assert sum(s.wall_s for s in ledger.categories.values()) == pytest.approx(400)
    paid = (92 * 2 + 78 * 1 + 220 * 2) / 3600
    assert ledger.node_hours == pytest.approx(paid)
    assert "nodes up early for the next launch: " in describe(ledger)


def test_the_report_says_when_a_resize_delay_is_modelled():
    from batchpilot.report.goodput import goodput_section

    ledger = build_ledger(EVENTS, now_s=420.0)
    assert ledger is not None
    assert "cluster.local_resize_delay_s" in goodput_section(ledger, modelled_resize_delay_s=10)
    assert "ready 10 s after each resize up" in goodput_section(ledger, modelled_resize_delay_s=10)
    assert "modelled" not in goodput_section(ledger)


def test_metrics_jsonl_gets_a_record_per_launch_that_step_readers_skip_and_a_rewrite_replaces():
    import json

    from batchpilot import runstate

    ledger = build_ledger(EVENTS, now_s=420.0)
    assert ledger is not None
    records = runstate.launch_records(
        ledger, [{**e, "nodes": 1} if e["kind"] == "launch" else e for e in EVENTS]
    )
    assert [(r["record"], r["launch"], r["stages"], r["exit_code"]) for r in records] == [
        ("launch", "launch-0", [0, 0], 0),
        ("launch", "launch-1", [1, 1], 0),
    ]
    launch_1 = records[1]
    assert launch_1["wall_s"] == pytest.approx(400 - 265)  # pod start to the job's end
    assert launch_1["categories"]["training_steps"]["wall_s"] == pytest.approx(95)
    assert launch_1["goodput"] == pytest.approx(95 / 135)  # 2 nodes throughout: the wall-time share
    steps = "".join(json.dumps({"step": k, "consumed_samples": 16 * k}) + "\n" for k in (1, 2))
    text = runstate.with_launch_records(steps, records)
    assert runstate.parse_metrics(text) == runstate.parse_metrics(steps)  # step readers see the steps only
    assert runstate.parse_launch_records(text) == records
    again = runstate.with_launch_records(text, records[:1])  # the next report replaces them
    assert runstate.parse_launch_records(again) == records[:1] and runstate.parse_metrics(
        again
    ) == runstate.parse_metrics(steps)
