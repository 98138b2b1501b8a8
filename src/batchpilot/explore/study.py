"""The effective-batch study: at the recommended micro batch, accumulate 2x, 4x, 8x, 16x micro-batches
and measure the gradient noise scale (the critical batch size), the gradient norm and the coherence.

It runs in fresh processes too (`python -m batchpilot.explore.study`, JSON on stdin, one result line),
laid out as the probes are: one process, or under fsdp/hsdp one per device of a node, sharded as the
stages shard. The model first trains `train_steps` optimizer steps on real data (the noise scale of an
untrained model says little), then, with the parameters frozen, every multiplier `k` measures
`measure_batches` batches of `k` passes of micro batch `m` over the `w` processes: from the gradient of
each pass `g_i` (batch `m w`: under fsdp every backward reduces over the ranks) and their mean (batch
`k m w`), `noise_terms` (McCandlish et al. 2018) gives unbiased |G|^2 and S; B_simple = mean S / mean
|G|^2. This is the trainer's own estimator under fsdp (first pass, micro x world, against the global
batch) with every pass used as a small batch; on one process `w` is 1. Coherence is the cosine between
the mean gradients of the two halves of the `k` passes: close to 0 when noise dominates a batch of
`k m w / 2`, close to 1 when the signal does.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from batchpilot.errors import BatchpilotError
from batchpilot.explore.process import run_ranks
from batchpilot.explore.records import ProbeRequest
from batchpilot.planning.nodes import nearest_valid_batch_sizes


@dataclass(frozen=True)
class StudyRequest:
    """The probe setup at the recommended size, plus what the study measures."""

    probe: ProbeRequest
    multipliers: list[int]
    measure_batches: int
    train_steps: int
    lr: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StudyRequest:
        data = json.loads(text)
        return cls(**{**data, "probe": ProbeRequest(**data["probe"])})


@dataclass
class MultiplierResult:
    """One accumulation multiplier: batch `multiplier x micro_batch_size x processes`."""

    multiplier: int
    global_batch_size: int
    noise_scale: float | None
    g2: float
    s: float
    grad_norm: float
    coherence: float


def _gradient_copy(grads: list[Any], *, sharded: bool) -> list[Any]:
    """fp32 copies to sum micro-batch gradients in: on the host for a whole model (as before sharding
    existed), on the device for this rank's FSDP shards (1/shard_degree of the model)."""
    return [g.float().clone() if sharded else g.float().cpu() for g in grads]


def _measure_multiplier(session: Any, request: StudyRequest, multiplier: int) -> dict[str, Any]:
    """|G|^2, S, gradient norm and coherence of `measure_batches` batches of `multiplier` micro-batches.

    A micro-batch's gradient is that of `micro x world` samples (under fsdp/hsdp every backward reduces
    over the ranks; on one process world is 1); norms and inner products are taken across the shards.
    """
    from batchpilot.train.noise import noise_terms
    from batchpilot.train.parallel import dot, gradients, squared_norm

    micro, world = request.probe.micro_batch_size, session.data_parallel_size
    group = session.parallel.shard_group  # sums over shards (None: whole tensors on one process)
    g2s, ss, norms, cosines = [], [], [], []
    for _ in range(request.measure_batches):
        batches = session.next_micro_batches(micro, multiplier)
        halves: list[list[Any] | None] = [None, None]
        small_sq = 0.0
        for index, batch in enumerate(batches):
            session.model.zero_grad(set_to_none=True)
            session.backward([batch])
            grads = _gradient_copy(gradients(session.model), sharded=session.parallel.sharded)
            small_sq += squared_norm(grads, group=group) / multiplier
            half = 0 if index < multiplier // 2 else 1
            total = halves[half]
            halves[half] = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
        first, second = halves
        assert first is not None and second is not None, "multipliers are at least 2"
        big_sq = squared_norm(
            [a + b for a, b in zip(first, second, strict=True)], group=group, scale=1 / multiplier
        )
        g2, s = noise_terms(
            small_sq_norm=small_sq,
            big_sq_norm=big_sq,
            b_small=micro * world,
            b_big=micro * multiplier * world,
        )
        g2s.append(g2)
        ss.append(s)
        norms.append(big_sq**0.5)
        sq_first, sq_second = squared_norm(first, group=group), squared_norm(second, group=group)
        cosines.append(
            dot(first, second, group=group) / (sq_first * sq_second) ** 0.5
            if sq_first * sq_second > 0
            else 0.0
        )
    session.model.zero_grad(set_to_none=True)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    g2, s = mean(g2s), mean(ss)
    return asdict(
        MultiplierResult(
            multiplier=multiplier,
            global_batch_size=micro * multiplier * world,
            noise_scale=s / g2 if g2 > 0 and s > 0 else None,
            g2=g2,
            s=s,
            grad_norm=mean(norms),
            coherence=mean(cosines),
        )
    )


def measure_study(request: StudyRequest) -> dict[str, Any]:
    """Runs the study in this process: {per_multiplier: [...]} or {error} / {user_error}."""
    import torch

    from batchpilot.explore.probe import open_session

    micro = request.probe.micro_batch_size
    try:
        with open_session(request.probe) as session:
            for group in session.optimizer.param_groups:
                group["lr"] = request.lr
            for _ in range(request.train_steps):
                session.timed_pass(micro)  # a training step on the next micro batch
            # Each multiplier reads the next samples: no batch is measured twice.
            return {"per_multiplier": [_measure_multiplier(session, request, k) for k in request.multipliers]}
    except BatchpilotError as error:
        return {"user_error": str(error)}
    except torch.cuda.OutOfMemoryError:
        return {"error": "CUDA out of memory"}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}".splitlines()[0][:500]}


def main() -> int:
    from batchpilot.explore.probe import emit, end_process_group

    request = StudyRequest.from_json(sys.stdin.read())
    emit(json.dumps(measure_study(request)))
    end_process_group()
    return 0


def run_study(*, request: StudyRequest, timeout_s: float) -> list[MultiplierResult]:
    """The study in a fresh process; a failure is one line naming explore.accumulation_multipliers."""
    ranks = run_ranks(
        module="batchpilot.explore.study",
        payload=request.to_json(),
        timeout_s=timeout_s,
        processes=request.probe.processes,
        failed=lambda result: "per_multiplier" not in result,
        timeout_field="explore.study_timeout_s",
    )
    # Every rank computes the same global numbers; a failing rank's report says why.
    failing = [result for result in ranks.results.values() if "per_multiplier" not in result]
    data = failing[0] if failing else None if ranks.reason else ranks.results.get(0)
    reason = ranks.reason
    if data is not None and data.get("user_error"):
        raise BatchpilotError("explore", f"the effective-batch study failed: {data['user_error']}")
    if data is None or "per_multiplier" not in data:
        problem = reason if data is None else data.get("error", "no result")
        raise BatchpilotError(
            "explore.accumulation_multipliers",
            f"the effective-batch study at micro_batch_size={request.probe.micro_batch_size} failed: {problem}",
            "raise explore.study_timeout_s, use smaller multipliers, or pass --no-study",
        )
    return [MultiplierResult(**item) for item in data["per_multiplier"]]


RANDOM_INIT = "random init"


def weights_of(init_from: str | None) -> str:
    """The explore.json `weights` of a study: `init_from gs://...` (train.init_from) or `random init`."""
    return RANDOM_INIT if init_from is None else f"init_from {init_from}"


@dataclass
class NoiseScaleReport:
    """The explore.json `noise_scale` section."""

    critical_batch_size: float | None
    per_multiplier: list[MultiplierResult]
    recommended_global_batch_size: int | None
    lr_scaling: str
    reasoning: list[str] = field(default_factory=list)
    micro_batch_size: int = 0
    train_steps: int = 0
    processes: int = 1
    weights: str = RANDOM_INIT
    """What the study's model started from: `init_from <train.init_from>` or `random init`."""
    critical_batch_at_most: int | None = None
    """When the estimate came out below the smallest batch measured (so the critical batch was not measured):
    that batch, which the critical batch is at most."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pooled_noise_scale(per_multiplier: list[MultiplierResult]) -> float | None:
    """B_simple from |G|^2 and S averaged over every multiplier (None when either is not positive)."""
    g2 = sum(r.g2 for r in per_multiplier) / len(per_multiplier)
    s = sum(r.s for r in per_multiplier) / len(per_multiplier)
    return s / g2 if g2 > 0 and s > 0 else None


def _nearest_valid(
    batch: float, *, micro_batch_size: int, devices_per_node: int, min_nodes: int, max_nodes: int
) -> int:
    """The global batch closest to `batch` that some node count splits into whole micro-batches."""
    below, above = nearest_valid_batch_sizes(
        max(1, round(batch)),
        node_range=range(min_nodes, max_nodes + 1),
        micro_batch_size=micro_batch_size,
        devices_per_node=devices_per_node,
        pp=1,
        tp=1,
    )
    options = [b for b in (below, above) if b is not None]
    assert options, "a micro batch always has a valid multiple"
    return min(options, key=lambda b: (abs(b - batch), -b))


def format_samples(value: float) -> str:
    """A batch size in samples for people: `12,345`, `48`, `0.43` (small noise scales are not zero)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.2g}"


def advise(
    *,
    per_multiplier: list[MultiplierResult],
    micro_batch_size: int,
    configured_global_batch_size: int,
    devices_per_node: int,
    min_nodes: int,
    max_nodes: int,
    train_steps: int,
    processes: int = 1,
    weights: str = RANDOM_INIT,
) -> NoiseScaleReport:
    """The critical batch size, a target global batch near it that the cluster can split, and an LR rule.

    An estimate below the smallest batch measured (`micro_batch_size` x `processes`) is not a measurement:
    the two batch sizes cannot resolve a noise scale below both, so it is reported as not measurable."""
    critical = pooled_noise_scale(per_multiplier)
    smallest = micro_batch_size * processes
    below_smallest = critical is not None and critical < smallest
    estimate = critical
    if below_smallest:
        critical = None
    report = NoiseScaleReport(
        critical_batch_size=critical,
        per_multiplier=per_multiplier,
        recommended_global_batch_size=None,
        lr_scaling="none",
        micro_batch_size=micro_batch_size,
        train_steps=train_steps,
        processes=processes,
        weights=weights,
    )
    sharded = (
        f" on {processes} sharded processes (small batch {micro_batch_size * processes})"
        if processes > 1
        else ""
    )
    measured_at = (
        f"measured at micro_batch_size={micro_batch_size}{sharded} after {train_steps} training step(s), pooled over "
        f"accumulation {', '.join(f'{r.multiplier}x' for r in per_multiplier)}"
    )
    if below_smallest:
        assert estimate is not None
        target = _nearest_valid(
            smallest, micro_batch_size=micro_batch_size, devices_per_node=devices_per_node, min_nodes=min_nodes,
            max_nodes=max_nodes,
        )  # fmt: skip
        report.critical_batch_at_most = smallest
        report.recommended_global_batch_size = target
        report.lr_scaling = "none"  # whether a batch is within twice an unmeasured critical batch is unknown
        report.reasoning = [
            f"the critical batch could not be measured ({measured_at}): B_simple came out "
            f"{format_samples(estimate)} samples, below the smallest batch measured ({smallest}), where two "
            f"batch sizes cannot resolve it; it is at most {smallest}",
            f"a critical batch at most the smallest batch: target the smallest global batch that "
            f"micro_batch_size={micro_batch_size} x devices makes, {target}; LR scaling none (whether a batch is "
            "within twice a critical batch that was not measured is unknown, and a batch-scaled LR could overshoot)",
        ]
        return report
    if critical is None:
        report.reasoning = [
            f"the gradient noise scale is not measurable here ({measured_at}): |G|^2 or S came out "
            "non-positive, i.e. the gradient noise swamps the signal at these batch sizes",
            "keep the configured global batch and train.lr_scaling; watch noise_scale in metrics.jsonl",
        ]
        return report
    target = _nearest_valid(
        critical,
        micro_batch_size=micro_batch_size,
        devices_per_node=devices_per_node,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
    )
    report.recommended_global_batch_size = target
    ratio = configured_global_batch_size / critical
    report.lr_scaling = "sqrt" if configured_global_batch_size <= 2 * critical else "none"
    optimal_lr_ratio = (1 + critical / micro_batch_size) / (1 + critical / configured_global_batch_size)
    report.reasoning = [
        f"critical batch size (B_simple, McCandlish et al. 2018) ~ {format_samples(critical)} samples, {measured_at}; "
        "it usually grows as the loss falls, so treat it as a lower estimate and watch noise_scale in "
        "metrics.jsonl",
        f"below it, doubling the global batch nearly halves the optimizer steps; above it, each doubling "
        f"buys less and costs more compute: target global batch {target} (the nearest size that "
        f"micro_batch_size={micro_batch_size} x devices x accumulation can make)",
        f"the configured global_batch_size {configured_global_batch_size} is {ratio:.2f}x the critical batch",
        f"LR scaling: {report.lr_scaling}: "
        + (
            "the configured batches stay in the noise-dominated range (at most 2x the critical batch), where "
            "the best LR still grows with the batch; for Adam-type optimizers such as batchpilot's AdamW "
            "about as its square root"
            if report.lr_scaling == "sqrt"
            else "the configured batch is well above the critical batch, where the best LR stops growing "
            "with the batch, so a batch-scaled LR would overshoot"
        )
        + f" (for SGD the same model predicts the best LR at the target {optimal_lr_ratio:.2f}x that at "
        f"micro_batch_size={micro_batch_size})",
    ]
    return report


if __name__ == "__main__":
    raise SystemExit(main())
