"""`cluster.launch.follow` after a job has ended: its nodes' log streams get one bound in all."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from torchx.specs import AppState

from batchpilot.cluster import launch
from batchpilot.cluster.launch_spec import LaunchSpec


class EndedJob:
    """A runner whose job has succeeded but whose nodes' log streams never end (a scheduler's log API that
    keeps a stream open after its pod is gone)."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def wait(self, handle: str, wait_interval: float) -> SimpleNamespace:
        return SimpleNamespace(state=AppState.SUCCEEDED, msg="")

    def log_lines(self, handle: str, **kwargs: object):
        self.closed.wait(60)
        yield from ()

    def close(self) -> None:
        """The test ends the streams itself, after `follow` returned."""

    def cancel(self, handle: str) -> None:
        raise AssertionError("a finished job is not cancelled")


def test_a_finished_jobs_streams_are_waited_for_within_one_bound_for_all_nodes(monkeypatch):
    monkeypatch.setattr(launch, "STREAM_TAIL_WAIT_S", 0.5)
    runner = EndedJob()
    spec = LaunchSpec(name="final", num_nodes=4, processes_per_node=1, trainer_args=(), env={})
    started = time.monotonic()
    try:
        code = launch.follow(
            runner, "job", spec=spec, role="trainer", wait_interval_s=0.1, via="test", where="here"
        )
    finally:
        runner.closed.set()
    # one bound for the four streams (0.5 s), not one per node (2 s)
    assert code == 0 and time.monotonic() - started < 1.5
