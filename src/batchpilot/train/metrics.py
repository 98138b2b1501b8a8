"""`metrics.jsonl`: one JSON line per optimizer step (the DESIGN.md contract), safe across resumes.

Free of torch: workflow code that never trains reads metrics through `read_metrics` / `load_metrics`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchpilot.files import write_atomically
from batchpilot.storage import ObjectNotFound, open_storage

METRICS_OBJECT = "metrics.jsonl"
"""Name of the copy kept beside the checkpoints (updated at every checkpoint), read by reports."""

METRIC_KEYS = (
    "step",
    "consumed_samples",
    "stage",
    "global_batch_size",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "peak_memory_bytes",
    "noise_scale",
    "val_loss",
)


class MetricsLog:
    """Appends step records; on resume, drops records of steps that the checkpoint does not contain."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_to(self, consumed_samples: int) -> None:
        """Keeps only records of steps that ended at or before `consumed_samples` (atomic rewrite).

        A record's `consumed_samples` is the count after its step, so these are the steps a checkpoint
        at `consumed_samples` contains; the steps after it are about to be trained again.
        """
        if not self.path.exists():
            return
        kept = [
            record for record in read_metrics(self.path) if record["consumed_samples"] <= consumed_samples
        ]
        write_atomically(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def replace_with(self, text: str) -> None:
        """Replaces the file's records (e.g. with the copy kept beside the checkpoints)."""
        write_atomically(self.path, text)

    def text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def append(self, record: dict[str, Any]) -> None:
        missing = [key for key in METRIC_KEYS if key not in record]
        assert not missing, f"metrics record lacks {missing}"
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """The records of metrics.jsonl text: one JSON object per non-blank line."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a local metrics.jsonl file."""
    return parse_metrics(Path(path).read_text())


def load_metrics(checkpoint_uri: str) -> list[dict[str, Any]]:
    """The records of the copy kept beside the checkpoints at `checkpoint_uri` ([] before the first one)."""
    try:
        text = open_storage(checkpoint_uri).read(METRICS_OBJECT).decode()
    except ObjectNotFound:
        return []
    return parse_metrics(text)
