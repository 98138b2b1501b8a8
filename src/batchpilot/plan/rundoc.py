"""The run document, `plan.json`: everything a later step needs, in one file that every step reads.

It holds the resolved config and a hash of it, a hash of the whole document (both make hand edits
visible: `plan` and the steps that rewrite the document recompute them), the part of the exploration the
plan used, how the micro batch was chosen, the stages with every derived setting (node counts,
accumulation, LR schedule) and, when a throughput was measured, the duration and node-hour estimate.
`launch`, `train`, the pipeline's tasks and the report all take this document; none rebuilds the plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from batchpilot import __version__
from batchpilot.config import AdaptiveRampup, Config, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.planning import CostEstimate, Plan
from batchpilot.planning.adaptive import StageDecision
from batchpilot.planning.capacity import LaunchCapacity
from batchpilot.planning.memory import MemoryPlan
from batchpilot.planning.trials import TrialsOutcome, TrialsPlan

FORMAT_VERSION = 4
"""4: `document_hash` covers the whole document (3 hashed the config alone)."""
MicroBatchSource = Literal["config", "explore", "override"]


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the config's canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def document_hash(document: dict[str, Any]) -> str:
    """sha256 of the document's canonical JSON without its own `document_hash` key, as it reads back
    (round-tripped through JSON, so a dict key that is no string hashes as the reader sees it)."""
    body = {key: value for key, value in document.items() if key != "document_hash"}
    return config_hash(json.loads(json.dumps(body)))


@dataclass(frozen=True)
class RunDocument:
    """The resolved config, the plan made from it, and what the plan was made with.

    Attributes:
        config: the resolved config (run-time overrides applied).
        plan: the stages, node counts and LR schedule.
        micro_batch_source: `config`, `explore` or `override` (the command line or a pipeline parameter).
        explore: what the plan used of explore.json (its recommendation and noise-scale estimate), or None.
        cost: durations and node-hours, when a per-device throughput was measured or given.
        notes: why the plan is what it is (e.g. the explored size that was not taken), for people.
        memory: the per-device memory estimate of every stage under the chosen strategy (None when the
            plan was made without the model's shape).
    """

    config: Config
    plan: Plan
    micro_batch_source: MicroBatchSource
    explore: dict[str, Any] | None = None
    cost: CostEstimate | None = None
    notes: tuple[str, ...] = ()
    memory: MemoryPlan | None = None
    decisions: tuple[StageDecision, ...] = ()
    """An adaptive ramp-up's decisions so far (the plan's stages follow from them); empty otherwise."""
    capacity: tuple[LaunchCapacity, ...] = ()
    """Launches that train on fewer nodes than planned (`cluster.fewer_nodes: allow`), as their resizes
    recorded them; the plan's stages of those launches carry the nodes they got and `planned_nodes`."""
    trials: TrialsPlan | None = None
    """The batch trials (`trials.enabled`): their branches, samples and share of the training."""
    trials_outcome: TrialsOutcome | None = None
    """The trials' results and decision, once they ran (the plan made after them carries them)."""
    goodput: dict[str, Any] | None = None
    """The run's goodput ledger (`planning.goodput.Ledger.to_dict`), in the run folder's record kept after
    the report; None in a plan."""

    def to_dict(self) -> dict[str, Any]:
        config = self.config.model_dump(mode="json")
        cost = None
        if self.cost is not None:
            cost = {
                **asdict(self.cost),
                "duration_s": self.cost.duration_s,
                "node_hours": self.cost.node_hours,
                "saving_ratio": self.cost.saving_ratio,
            }
        document = {
            "format_version": FORMAT_VERSION,
            "batchpilot_version": __version__,
            "config_hash": config_hash(config),
            "config": config,
            "micro_batch_source": self.micro_batch_source,
            "explore": self.explore,
            "cost": cost,
            "run_notes": list(self.notes),
            "memory": self.memory.to_dict() if self.memory else None,
            **self.plan.to_dict(),
            **self._adaptive(),
            **({"capacity": [record.to_dict() for record in self.capacity]} if self.capacity else {}),
            **({"trials": self.trials.to_dict()} if self.trials else {}),
            **({"trials_outcome": self.trials_outcome.to_dict()} if self.trials_outcome else {}),
            **({"goodput": self.goodput} if self.goodput is not None else {}),
        }
        return {**document, "document_hash": document_hash(document)}

    def _adaptive(self) -> dict[str, Any]:
        """The decision log of an adaptive ramp-up (no key for any other ramp-up)."""
        if not isinstance(self.config.batch.rampup, AdaptiveRampup):
            return {}
        return {"adaptive_decisions": [decision.to_dict() for decision in self.decisions]}

    def to_json(self) -> str:
        """Deterministic JSON text (same input, same bytes)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


def parse_run_document(text: str, *, source: str = "plan.json") -> RunDocument:
    """Reads a plan.json text; refuses another format version, or a config or any other part edited after
    batchpilot wrote it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise BatchpilotError(source, f"is not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else None
        raise BatchpilotError(
            f"{source}: format_version",
            f"is {found!r}, this batchpilot {__version__} reads {FORMAT_VERSION}",
            "make the plan again with `batchpilot plan --config ... --out plan.json`",
        )
    if not isinstance(data.get("config"), dict) or data.get("config_hash") != config_hash(data["config"]):
        raise BatchpilotError(
            f"{source}: config",
            "does not match the plan's config_hash: the config was edited after the plan was made, so its "
            "stages may no longer follow from it",
            "make the plan again from the edited config with `batchpilot plan --config ... --out plan.json`",
        )
    if data.get("document_hash") != document_hash(data):
        raise BatchpilotError(
            source,
            "its stages or other parts were edited after batchpilot wrote it (document_hash mismatch), so they "
            "may no longer follow from its config",
            "make the plan again with `batchpilot plan --config ... --out plan.json` (edit the config, not the plan)",
        )
    return _run_document(data)


def _run_document(data: dict[str, Any]) -> RunDocument:
    """The document of a parsed plan.json whose hashes matched."""
    cost = data.get("cost")
    return RunDocument(
        config=parse_config(data["config"]),
        plan=Plan.from_dict(data),
        micro_batch_source=data["micro_batch_source"],
        explore=data.get("explore"),
        cost=_cost_from_dict(cost) if cost else None,
        notes=tuple(data.get("run_notes", ())),
        memory=MemoryPlan.from_dict(data["memory"]) if data.get("memory") else None,
        decisions=tuple(StageDecision.from_dict(item) for item in data.get("adaptive_decisions", ())),
        capacity=tuple(LaunchCapacity.from_dict(item) for item in data.get("capacity", ())),
        trials=TrialsPlan.from_dict(data["trials"]) if data.get("trials") else None,
        trials_outcome=TrialsOutcome.from_dict(data["trials_outcome"])
        if data.get("trials_outcome")
        else None,
        goodput=data.get("goodput"),
    )


def _cost_from_dict(data: dict[str, Any]) -> CostEstimate:
    from batchpilot.planning.cost import StageCost

    return CostEstimate(
        stages=tuple(StageCost(**stage) for stage in data["stages"]),
        samples_per_s_per_device=data["samples_per_s_per_device"],
        static_pool_node_hours=data["static_pool_node_hours"],
    )


def read_run_document(path: str | Path) -> RunDocument:
    """The run document at `path`, or a one-line error naming the file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise BatchpilotError("--plan", f"cannot read {path}: {error.strerror}") from None
    return parse_run_document(text, source=str(path))
