"""What a pool's wait reports when fewer nodes than asked for came in time."""

from __future__ import annotations

from batchpilot.errors import BatchpilotError


class CapacityShortfall(BatchpilotError):
    """The pool has `ready` of the `wanted` nodes when its wait ended (a stockout, a quota, a local
    capacity limit). The pipeline's resize may train the launch on fewer nodes (`cluster.fewer_nodes`)."""

    def __init__(self, field: str, problem: str, fix: str | None = None, *, ready: int, wanted: int) -> None:
        super().__init__(field, problem, fix)
        self.ready = ready
        self.wanted = wanted
