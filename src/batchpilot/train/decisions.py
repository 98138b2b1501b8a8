"""The adaptive ramp-up's decision log, `<checkpoint_uri>/adaptive.json`: the stages decided so far.

The trainer writes it when a stage's rule fires (after the checkpoint that ends the stage, which carries
the same decisions: the checkpoint is the authority, this file the copy the pipeline's next tasks read);
the next slot's resize and launch rebuild the plan from it (`batchpilot.planner.build_plan`). No torch
here: the pipeline's pool task reads it too.
"""

from __future__ import annotations

import json

from batchpilot.planning.adaptive import StageDecision
from batchpilot.storage import ObjectNotFound, open_storage

DECISIONS_OBJECT = "adaptive.json"


def read_decisions(checkpoint_uri: str) -> list[StageDecision]:
    """The decisions recorded beside the checkpoints (none before the first stage ends)."""
    try:
        data = json.loads(open_storage(checkpoint_uri).read(DECISIONS_OBJECT))
    except ObjectNotFound:
        return []
    return [StageDecision.from_dict(item) for item in data["decisions"]]


def write_decisions(checkpoint_uri: str, decisions: list[StageDecision]) -> None:
    text = json.dumps({"decisions": [decision.to_dict() for decision in decisions]}, indent=2)
    open_storage(checkpoint_uri).write(DECISIONS_OBJECT, text.encode())
