"""What sits beside a run's checkpoints, under `train.checkpoint_uri`: the one owner of its layout.

Every reader and writer of these objects goes through this module (no torch here: the pipeline's tasks,
the report and the trials read them without a trainer):

- the checkpoints: a step folder `<step:09d>/` with its objects and `<step:09d>/meta.json`, and `latest`,
  the pointer to the newest committed step, written last with a generation precondition (the commit
  protocol itself is `train.checkpoint`'s; this module names the objects and reads and moves the pointer);
- `metrics.jsonl`: one JSON line per optimizer step, copied beside the checkpoints at every checkpoint
  (and the trainer's local copy, `MetricsLog`);
- `adaptive.json`: an adaptive ramp-up's decisions so far;
- `capacity.json`: the launches that train on fewer nodes than planned;
- `micro_batch.json`: the micro batch each stage was halved to after running out of memory;
- `canary/canary.json`: the canary job's summary;
- `branch.json`: a trials branch's record of the checkpoint it was copied from (which run, which sample),
  so its first launch may continue another run's weights and says so (`config.identity`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchpilot.errors import BatchpilotError
from batchpilot.files import write_atomically
from batchpilot.planning.adaptive import StageDecision
from batchpilot.planning.capacity import LaunchCapacity
from batchpilot.storage import ObjectNotFound, PreconditionFailed, Storage, join_uri, open_storage

LATEST = "latest"
META = "meta.json"
STEP_FOLDER = re.compile(r"^(\d{9})/")
METRICS_OBJECT = "metrics.jsonl"
"""Name of the copy kept beside the checkpoints (updated at every checkpoint), read by reports."""
DECISIONS_OBJECT = "adaptive.json"
CAPACITY_OBJECT = "capacity.json"
"""Beside the checkpoints: the launches that train on fewer nodes than planned (`LaunchCapacity`)."""
MICRO_BATCH_OBJECT = "micro_batch.json"
"""Beside the checkpoints: the micro batch each stage was halved to after running out of memory, so a
retried or resumed stage starts with the size that fits (`{"stages": {"<index>": size}}`)."""
BRANCH_OBJECT = "branch.json"
"""Beside a trials branch's copied checkpoint: `{"source": uri, "run": id, "consumed_samples": n}`."""
CANARY_FOLDER = "canary"
CANARY_FILE = "canary.json"


# --- the checkpoints' layout --------------------------------------------------------------------------


def step_folder(step: int) -> str:
    """A step's folder (object name prefix): `000000010`."""
    return f"{step:09d}"


def meta_name(step: int) -> str:
    """A step's meta.json object name."""
    return f"{step_folder(step)}/{META}"


def latest_step(storage: Storage) -> int | None:
    """The step `latest` points to, or None before the first checkpoint."""
    try:
        text = storage.read(LATEST).decode().strip()
    except ObjectNotFound:
        return None
    if not text.isdigit():
        raise BatchpilotError(f"{storage.uri}/{LATEST}", f"does not name a step ({text[:40]!r})")
    return int(text)


def read_meta(storage: Storage, step: int) -> dict[str, Any]:
    """A committed step's meta.json."""
    data: dict[str, Any] = json.loads(storage.read(meta_name(step)))
    return data


def write_meta(storage: Storage, step: int, meta: dict[str, Any]) -> None:
    storage.write(meta_name(step), json.dumps(meta, indent=2).encode())


def move_latest(storage: Storage, step: int) -> None:
    """Points `latest` at `step` (the commit's last write), refusing a concurrent writer.

    The generation precondition makes a concurrent writer fail loudly instead of two runs silently
    interleaving; a retried write whose first attempt succeeded (its response lost) finds `latest` at its
    own step and counts as done."""
    try:
        generation = storage.stat(LATEST).generation
    except ObjectNotFound:
        generation = 0
    try:
        storage.write(LATEST, f"{step_folder(step)}\n".encode(), if_generation_match=generation)
    except PreconditionFailed:
        if latest_step(storage) != step:
            raise


def step_numbers(storage: Storage) -> list[int]:
    """Every step that has a folder (committed or not), ascending."""
    return sorted({int(m.group(1)) for name in storage.list() if (m := STEP_FOLDER.match(name))})


def committed_steps(storage: Storage) -> list[int]:
    """The steps of the committed checkpoints (a step folder with meta.json), ascending."""
    return sorted(
        int(name[:9]) for name in storage.list() if name.endswith(f"/{META}") and name[:9].isdigit()
    )


def latest_checkpoint(uri: str) -> tuple[str, int] | None:
    """(step folder, consumed_samples) of the checkpoint `latest` names under `uri`, or None."""
    storage = open_storage(uri)
    step = latest_step(storage)
    if step is None:
        return None
    return step_folder(step), int(read_meta(storage, step)["consumed_samples"])


def latest_meta(uri: str) -> dict[str, Any] | None:
    """The meta.json of the checkpoint `latest` names under `uri`, or None before the first checkpoint."""
    storage = open_storage(uri)
    step = latest_step(storage)
    return None if step is None else read_meta(storage, step)


def copy_latest_checkpoint(source_uri: str, target_uri: str) -> int | None:
    """Copies the checkpoint `latest` names under `source_uri` to an emptied `target_uri` (its step folder's
    objects, the branch record, then `latest`, last, as a save commits); returns its consumed_samples, None
    when there is none."""
    found = latest_checkpoint(source_uri)
    if found is None:
        return None
    folder, consumed = found
    source, target = open_storage(source_uri), open_storage(target_uri)
    for name in target.list():  # a previous attempt's checkpoints and metrics: the copy starts over
        target.delete(name)
    for name in source.list(f"{folder}/"):
        target.write(name, source.read(name))
    run = read_meta(source, int(folder)).get("run") or {}
    record = {"source": source_uri, "run": run.get("id"), "consumed_samples": consumed}
    target.write(BRANCH_OBJECT, json.dumps(record, indent=2).encode())
    target.write(LATEST, f"{folder}\n".encode())
    return consumed


def read_branch(storage: Storage) -> dict[str, Any] | None:
    """The branch record beside a trials branch's checkpoints (`BRANCH_OBJECT`), or None."""
    try:
        data: dict[str, Any] = json.loads(storage.read(BRANCH_OBJECT))
    except ObjectNotFound:
        return None
    return data


# --- metrics.jsonl ------------------------------------------------------------------------------------

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
    """The trainer's local metrics.jsonl: appends step records; on resume, drops records of steps that the
    checkpoint does not contain."""

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


LAUNCH_RECORD = "launch"
"""The `record` of a launch's goodput line in metrics.jsonl (written at the report step); step records have no
`record` key."""


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl text (one JSON object per non-blank line; launch records left out:
    `parse_launch_records`)."""
    return [record for record in _parse_lines(text) if "record" not in record]


def parse_launch_records(text: str) -> list[dict[str, Any]]:
    """The launch records of metrics.jsonl text: one per launch, its share of the goodput ledger."""
    return [record for record in _parse_lines(text) if record.get("record") == LAUNCH_RECORD]


def _parse_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def launch_records(ledger: Any, events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A metrics.jsonl record per launch of the ledger (`planning.goodput.Ledger`): its stages and nodes (from
    its `launch` event), wall time, node-hours and goodput, and each category's share."""
    launched = {e["launch"]: e for e in events if e["kind"] == "launch"}
    records = []
    for name, shares in ledger.launches.items():
        event = launched.get(name, {})
        paid = sum(share.node_hours for share in shares.values())
        trained = shares["training_steps"].node_hours if "training_steps" in shares else 0.0
        records.append(
            {
                "record": LAUNCH_RECORD,
                "launch": name,
                "stages": event.get("stages"),
                "nodes": event.get("nodes"),
                "exit_code": event.get("exit_code"),
                "wall_s": sum(share.wall_s for share in shares.values()),
                "node_hours": paid,
                "goodput": trained / paid if paid > 0 else None,
                "categories": {
                    k: {"wall_s": v.wall_s, "node_hours": v.node_hours} for k, v in shares.items()
                },
            }
        )
    return records


def with_launch_records(text: str, records: Sequence[dict[str, Any]]) -> str:
    """metrics.jsonl text with its launch records replaced by `records` (after the step records)."""
    lines = [
        line for line in text.splitlines() if line.strip() and json.loads(line).get("record") != LAUNCH_RECORD
    ]
    return "".join(line + "\n" for line in lines) + "".join(json.dumps(r) + "\n" for r in records)


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


def restore_metrics(metrics: MetricsLog, storage: Storage, *, consumed: int) -> None:
    """Starts from the metrics kept beside the checkpoints (a new pod has no local copy), up to `consumed`."""
    if storage.exists(METRICS_OBJECT):
        metrics.replace_with(storage.read(METRICS_OBJECT).decode())
    metrics.truncate_to(consumed)


# --- adaptive.json ------------------------------------------------------------------------------------


def read_decisions(checkpoint_uri: str) -> list[StageDecision]:
    """An adaptive ramp-up's decisions recorded beside the checkpoints (none before the first stage ends).

    The trainer writes them when a stage's rule fires (the checkpoint that ends the stage carries the same
    trace: the checkpoint is the authority, this object the copy the pipeline's next tasks read)."""
    try:
        data = json.loads(open_storage(checkpoint_uri).read(DECISIONS_OBJECT))
    except ObjectNotFound:
        return []
    return [StageDecision.from_dict(item) for item in data["decisions"]]


def write_decisions(checkpoint_uri: str, decisions: Sequence[StageDecision]) -> None:
    text = json.dumps({"decisions": [decision.to_dict() for decision in decisions]}, indent=2)
    open_storage(checkpoint_uri).write(DECISIONS_OBJECT, text.encode())


# --- capacity.json ------------------------------------------------------------------------------------


def read_capacity(checkpoint_uri: str) -> list[LaunchCapacity]:
    """The capacity records of the run (none when every launch got its planned nodes)."""
    try:
        data = json.loads(open_storage(checkpoint_uri).read(CAPACITY_OBJECT))
    except ObjectNotFound:
        return []
    return [LaunchCapacity.from_dict(item) for item in data["launches"]]


def record_capacity(
    checkpoint_uri: str, *, first_stage: int, last_stage: int, record: LaunchCapacity | None
) -> None:
    """Replaces the record of the launch of stages `first_stage`..`last_stage` (None: removes it; nothing
    is written when nothing changes)."""
    before = read_capacity(checkpoint_uri)
    after = [r for r in before if (r.first_stage, r.last_stage) != (first_stage, last_stage)]
    after += [record] if record is not None else []
    if after != before:
        text = json.dumps({"launches": [r.to_dict() for r in after]}, indent=2) + "\n"
        open_storage(checkpoint_uri).write(CAPACITY_OBJECT, text.encode())


# --- micro_batch.json ---------------------------------------------------------------------------------


def read_micro_batch_overrides(storage: Storage) -> dict[int, int]:
    """The halved micro batches recorded by earlier attempts (MICRO_BATCH_OBJECT), by stage index."""
    try:
        data = json.loads(storage.read(MICRO_BATCH_OBJECT))
    except ObjectNotFound:
        return {}
    return {int(index): int(size) for index, size in data["stages"].items()}


def write_micro_batch_overrides(storage: Storage, overrides: dict[int, int]) -> None:
    data = {"stages": {str(index): size for index, size in sorted(overrides.items())}}
    storage.write(MICRO_BATCH_OBJECT, json.dumps(data, indent=2).encode())


def micro_batch_uri(storage: Storage) -> str:
    return join_uri(storage.uri, MICRO_BATCH_OBJECT)


# --- canary/canary.json -------------------------------------------------------------------------------


def canary_uri(checkpoint_uri: str) -> str:
    """`<train.checkpoint_uri>/canary`: where the canary's probes go and its rank 0 writes canary.json."""
    return f"{checkpoint_uri.rstrip('/')}/{CANARY_FOLDER}"


def write_canary(result_uri: str, summary: dict[str, Any]) -> str:
    """Writes canary.json under `result_uri` (the canary folder); returns its URI."""
    open_storage(result_uri).write(CANARY_FILE, json.dumps(summary, indent=1).encode())
    return join_uri(result_uri, CANARY_FILE)


def read_canary(checkpoint_uri: str) -> dict[str, Any] | None:
    """The last canary's canary.json under the checkpoint URI, or None when no canary ran there."""
    try:
        data: dict[str, Any] = json.loads(open_storage(canary_uri(checkpoint_uri)).read(CANARY_FILE))
    except ObjectNotFound:
        return None
    return data


# --- ledger/*.json: the goodput ledger's events ------------------------------------------------------------

LEDGER_FOLDER = "ledger"


def record_event(checkpoint_uri: str, event: dict[str, Any]) -> None:
    """One goodput event (`planning.goodput`: `pool`, `launch`, `trainer`) as its own object under
    `<checkpoint_uri>/ledger/`: tasks and trainers on different machines each write theirs, nothing is
    appended to (an object store has no append). The ledger observes the run: a write that fails (storage,
    credentials, the disk) is a warning naming what the ledger misses, and the run goes on."""
    import logging
    import time
    import uuid

    name = f"{time.time_ns():020d}-{event['kind']}-{uuid.uuid4().hex[:8]}.json"
    try:
        open_storage(join_uri(checkpoint_uri, LEDGER_FOLDER)).write(name, json.dumps(event).encode())
    except (BatchpilotError, OSError) as error:
        logging.getLogger(__name__).warning(
            "the goodput ledger misses this %s event: %s", event["kind"], error
        )


def read_events(checkpoint_uri: str, *, kind: str | None = None) -> list[dict[str, Any]]:
    """Every goodput event recorded under the checkpoint URI (of `kind` only: one listing, and only those
    objects read), in the order they were written."""
    storage = open_storage(join_uri(checkpoint_uri, LEDGER_FOLDER))
    names = sorted(
        name for name in storage.list() if name.endswith(".json") and (kind is None or f"-{kind}-" in name)
    )
    return [json.loads(storage.read(name)) for name in names]


# --- progress/<first>-<last>.json: a running launch's progress (cluster.capacity_ahead) ---------------------

PROGRESS_FOLDER = "progress"


def progress_name(stages: Sequence[int]) -> str:
    """The progress object of the job training stages `stages[0]..stages[-1]`."""
    return f"{stages[0]}-{stages[-1]}.json"


def write_progress(checkpoint_uri: str, *, stages: Sequence[int], progress: dict[str, Any]) -> None:
    """The main trainer's latest progress (`planning.ahead.Progress`'s fields), replacing the one before. Like
    the ledger it observes the run: a failed write is a warning and training goes on."""
    import logging

    try:
        open_storage(join_uri(checkpoint_uri, PROGRESS_FOLDER)).write(
            progress_name(stages), json.dumps(progress).encode()
        )
    except (BatchpilotError, OSError) as error:
        logging.getLogger(__name__).warning("the launch's progress record was not written: %s", error)


def read_progress(checkpoint_uri: str, *, stages: Sequence[int]) -> dict[str, Any] | None:
    """The progress the job training `stages` last wrote, or None before it wrote any."""
    try:
        data: dict[str, Any] = json.loads(
            open_storage(join_uri(checkpoint_uri, PROGRESS_FOLDER)).read(progress_name(stages))
        )
    except ObjectNotFound:
        return None
    return data
