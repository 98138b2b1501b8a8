"""`train.min_step_s`: every optimizer step lasts at least that long, so a stage runs long enough to watch
(`batchpilot rehearse` paces its tiny model so on any hardware)."""

from __future__ import annotations

import itertools
import json
import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from batchpilot.config import parse_config
from batchpilot.plan.stages import build_plan
from batchpilot.train import trainer

STEPS = 4
PACE_S = 2.0


def _worker(rank: int, port: int, root: str, data_uri: str, min_step_s: float) -> None:
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    config = parse_config(
        {
            "name": "paced",
            "model": {"args": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}},
            "data": {"uri": data_uri, "seq_len": 32},
            "cluster": {"devices_per_node": 1, "max_nodes": 1},
            "batch": {"global_batch_size": 2, "micro_batch_size": 2},
            "train": {
                "total_samples": 2 * STEPS, "lr": 1e-3, "checkpoint_uri": f"file://{root}/ckpt",
                "checkpoint_every_s": 0, "eval_samples": 0, "min_step_s": min_step_s,
            },
        }
    )  # fmt: skip
    assert trainer.train(config=config, plan=build_plan(config, micro_batch_size=2), stage="all",
                         output_dir=Path(root) / "out") == 0  # fmt: skip


@pytest.mark.slow
def test_each_step_lasts_at_least_min_step_s(demo_data_uri, tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path), demo_data_uri, PACE_S), nprocs=1, join=True)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    # A record is written when its step's work is done: from one step's start to the next is the gap between
    # their records plus the earlier step's own time (step_time_s), and the loop sleeps until it is PACE_S.
    # (Up to a millisecond off: the record's clock is read a little after the step's time is taken.)
    spans = [b["time"] - a["time"] + a["step_time_s"] for a, b in itertools.pairwise(records)]
    assert min(spans) >= PACE_S - 0.001, spans
    assert (
        max(r["step_time_s"] for r in records) < PACE_S
    )  # the work alone is shorter (a tiny model's step: well under a second even on a loaded machine)
