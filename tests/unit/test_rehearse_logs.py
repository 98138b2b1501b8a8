"""The rehearsal looks for a trainer's line (the resume line) in every pod of a JobSet: rank 0 logs it, and
torchrun's c10d rendezvous numbers the nodes in the order they join, so rank 0 may run in any pod (the
stage change on 2 nodes failed on a loaded machine when only the first pod was read)."""

from __future__ import annotations

from batchpilot.rehearse.cluster import Pod
from batchpilot.rehearse.steps import RESUMED, logged


class Logs:
    """A ClusterView's `log` over a dict of pod name -> log text."""

    def __init__(self, **logs: str) -> None:
        self.logs = logs

    def log(self, name: str) -> str:
        return self.logs[name]


def pod(name: str) -> Pod:
    return Pod(name=name, phase="Running", restart_attempt="0", deleting=False)


def test_the_resume_line_is_found_in_whichever_pod_holds_rank_0():
    line = "[batchpilot] resumed from step 25 (25 samples) of gs://b/ckpt (saved by 1 process(es) under ddp)"
    assert RESUMED.search(line) is not None
    view = Logs(**{"js-0-0": "[batchpilot] training final on 2 process(es)\n", "js-0-1": line})
    found = logged(view, [pod("js-0-0"), pod("js-0-1")], RESUMED)  # type: ignore[arg-type]
    assert found is not None and found.group(1) == "25"
    assert logged(view, [pod("js-0-0")], RESUMED) is None  # type: ignore[arg-type]
