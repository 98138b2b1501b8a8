"""CPU threads of local trainer processes: one number shared by the launcher and explore's probes."""

from __future__ import annotations

import os

from batchpilot.errors import BatchpilotError


def local_trainer_threads() -> int:
    """CPU threads of each local trainer process (OMP_NUM_THREADS, 1 unless the user set it).

    One process per "device" on a shared machine: more threads per process would only fight over the
    same cores. Explore's probes use the same number, so they measure what a trainer will see.
    """
    value = os.environ.get("OMP_NUM_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise BatchpilotError("OMP_NUM_THREADS", f"is {value!r}", "set it to a positive integer or unset it")
    return int(value)
