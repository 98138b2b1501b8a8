"""What a probe is asked and what it reports: plain dataclasses that travel as one JSON line.

No torch here: the parent process (the search) only reads these records; the probe process makes them.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from batchpilot.errors import BatchpilotError

RESULT_MARKER = "BATCHPILOT_PROBE_RESULT"
"""The prefix of the one result line a probe or study process prints on stdout."""


@contextlib.contextmanager
def factory_errors(factory: str) -> Iterator[None]:
    """Any failure of the user's model factory as one line naming model.factory (no probe can avoid it)."""
    try:
        yield
    except BatchpilotError:
        raise
    except Exception as error:
        raise BatchpilotError("model.factory", f"{factory} raised {type(error).__name__}: {error}") from None


@dataclass(frozen=True)
class Setting:
    """How the model runs: the knobs a probe varies besides the micro batch."""

    activation_checkpointing: bool
    compile: bool = False

    def label(self) -> str:
        """`activation checkpointing off` (plus `, compiled` when compiled)."""
        text = f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}"
        return text + (", compiled" if self.compile else "")


class _Configuration:
    """What a probe's request and its result share: the setting measured, and their JSON line."""

    activation_checkpointing: bool
    compile: bool

    @property
    def setting(self) -> Setting:
        return Setting(self.activation_checkpointing, self.compile)

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]


@dataclass(frozen=True)
class ProbeLayout:
    """How every probe of an exploration runs: the stages' strategy and the processes of one probe.

    Attributes:
        parallelism: `ddp`, `fsdp` or `hsdp` (`planner.probe_parallelism`).
        processes: 1 under ddp (a replica holds the whole model, as one bare process does); under
            fsdp/hsdp one process per device of a node (`cluster.devices_per_node`), sharded as the
            stages shard (hsdp shards within a node, so one node is what a device sees).
    """

    parallelism: str = "ddp"
    processes: int = 1
    tensor_parallel_size: int = 1
    """Processes of the probe that split each block (train.tensor_parallel_size), as a stage's node does."""

    def line(self) -> str:
        """`probes run as 2 processes under fsdp (what the stages run)`."""
        if self.tensor_parallel_size > 1:
            return (
                f"probes run as {self.processes} processes under {self.parallelism}, each block split "
                f"{self.tensor_parallel_size} ways (what a node of the stages runs)"
            )
        if self.processes > 1:
            return f"probes run as {self.processes} processes under {self.parallelism} (what the stages run)"
        if self.parallelism == "ddp":
            return (
                "probes run as 1 process: under ddp a device holds the whole model as one process does "
                "(what the stages run, apart from DDP's gradient buckets)"
            )
        return f"probes run as 1 process under {self.parallelism} (one device per node: nothing to shard)"


def probe_layout(*, parallelism: str, devices_per_node: int, tensor_parallel_size: int = 1) -> ProbeLayout:
    """The probes' layout for the stages' strategy (see ProbeLayout)."""
    sharded = parallelism in ("fsdp", "hsdp")
    return ProbeLayout(
        parallelism=parallelism,
        processes=devices_per_node if sharded else 1,
        tensor_parallel_size=tensor_parallel_size,
    )


@dataclass(frozen=True)
class ProbeRequest(_Configuration):
    """Everything one probe process needs (sent as JSON on its stdin).

    Attributes:
        factory, model_args: `model.factory` and `model.args`.
        data_uri, split, seq_len, seed, verify_checksums: the real training data to read.
        micro_batch_size, activation_checkpointing, compile: the configuration measured.
        warmup_steps: untimed steps first (allocation, lazy initialisation).
        timed_steps: at least this many timed steps ...
        min_timed_s: ... and more until the timed steps add up to this (short steps are noisy).
        memory_budget_bytes: on CPU, a peak resident set above this does not fit.
        precision: `train.precision` (auto, fp32, bf16).
        cpu_threads: on CPU, torch's intra-op threads (the local trainers' count); None = torch's default.
        reference_micro_batch_size, reference_activation_checkpointing: the base probe's configuration;
            when set, every timed pass is paired with a pass of it in the same process (see
            `ProbeResult.pair_ratios`). None: no reference (the base probe itself, or another compile
            setting than the reference's).
        parallelism: how the probe wraps the model (`train.parallelism` resolved, see `ProbeLayout`).
        processes: how many processes the probe runs as (one node; each data-parallel rank reads its own
            samples).
        tensor_parallel_size: processes that split each block and share one data-parallel rank's samples.
        init_from: `train.init_from`, whose weights the model loads right after it is built; set for the
            effective-batch study only (a speed probe's timing does not depend on the weights).
    """

    factory: str
    model_args: dict[str, Any]
    data_uri: str
    split: str
    seq_len: int
    seed: int
    verify_checksums: bool
    micro_batch_size: int
    activation_checkpointing: bool
    compile: bool
    warmup_steps: int
    timed_steps: int
    min_timed_s: float
    memory_budget_bytes: int
    precision: str = "auto"
    cpu_threads: int | None = None
    reference_micro_batch_size: int | None = None
    reference_activation_checkpointing: bool = False
    parallelism: str = "ddp"
    processes: int = 1
    init_from: str | None = None
    tensor_parallel_size: int = 1

    @classmethod
    def from_json(cls, text: str) -> ProbeRequest:
        return cls(**json.loads(text))


@dataclass
class ProbeResult(_Configuration):
    """One measurement; `fits` is False when it ran out of memory, exceeded the budget, crashed or hung.

    Attributes:
        step_time_s: median time of one forward + backward pass of one micro batch (the optimizer step
            is left out: its cost is per global batch, the same whatever the micro batch).
        step_times_s: every timed pass, for the noise estimate.
        repeats: number of timed passes.
        error: why it does not fit (None when it fits).
        user_error: a problem with the user's input (model factory, dataset) that no other probe can
            avoid; the search stops with this one line.
        device: `cpu` or `cuda`.
        duration_s: wall-clock time of the probe process.
        pair_ratios: for each timed pass, this size's throughput over the reference's (the base probe's
            configuration) measured right next to it. A shared machine's speed can change by a third for
            seconds at a time; both passes of a pair see the same speed, so the ratio does not.
        relative_throughput: the median of `pair_ratios` (1.0 for the base probe itself; None when the
            probe had no reference).
    """

    micro_batch_size: int
    activation_checkpointing: bool
    compile: bool
    fits: bool
    peak_memory_bytes: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    repeats: int = 0
    error: str | None = None
    user_error: str | None = None
    device: str = "cpu"
    duration_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    pair_ratios: list[float] = field(default_factory=list)
    relative_throughput: float | None = None

    @classmethod
    def not_fitting(cls, request: ProbeRequest, error: str | None = None) -> ProbeResult:
        """A result of `request` that does not fit (yet: the probe fills it in as it measures)."""
        return cls(
            micro_batch_size=request.micro_batch_size,
            activation_checkpointing=request.activation_checkpointing,
            compile=request.compile,
            fits=False,
            error=error,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def public(self) -> dict[str, Any]:
        """The explore.json form (the contract keys of docs/architecture.md first)."""
        record = asdict(self)
        record.pop("user_error")
        return record


def timing_from_steps(
    *, step_times_s: list[float], micro_batch_size: int, seq_len: int, tensor_parallel_size: int = 1
) -> dict[str, Any]:
    """step_time_s (median), tokens/s and samples/s per device of one micro batch from its timed passes (the
    `tensor_parallel_size` devices of a data-parallel rank share its micro batch)."""
    median_s = statistics.median(step_times_s)
    return {
        "step_time_s": median_s,
        "tokens_per_s": micro_batch_size * seq_len / tensor_parallel_size / median_s,
        "samples_per_s": micro_batch_size / tensor_parallel_size / median_s,
        "repeats": len(step_times_s),
        "step_times_s": list(step_times_s),
    }


def pair_ratios(
    *,
    times_s: list[float],
    reference_times_s: list[float],
    micro_batch_size: int,
    reference_micro_batch_size: int,
) -> list[float]:
    """Per pair of passes, the probe's throughput over the reference's (samples/s over samples/s)."""
    return [
        (micro_batch_size / elapsed) / (reference_micro_batch_size / reference_s)
        for elapsed, reference_s in zip(times_s, reference_times_s, strict=True)
    ]


def merge_ranks(request: ProbeRequest, *, results: dict[int, dict[str, Any]], reason: str) -> ProbeResult:
    """One probe's result from what its processes reported.

    A probe fits only if every rank fit and none crashed or hung (`reason`). The peak memory is the
    largest peak any rank reported (the per-device peak); the timing is rank 0's, which every rank
    already agreed on (each pass's time is the slowest rank's). A failing rank's error names the rank.
    """
    peaks = [data["peak_memory_bytes"] for data in results.values() if data.get("peak_memory_bytes")]
    failing = [rank for rank in sorted(results) if not results[rank].get("fits")]
    if reason:
        merged = ProbeResult.not_fitting(request, error=reason)
    elif failing:
        merged = ProbeResult.from_dict(results[failing[0]])
        if request.processes > 1 and merged.error:
            merged.error = f"rank {failing[0]} of {request.processes}: {merged.error}"
    else:
        merged = ProbeResult.from_dict(results[0])
    merged.peak_memory_bytes = max(peaks, default=None)
    return merged
