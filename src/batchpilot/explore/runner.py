"""`run_exploration`: the search loop with its budgets, interim recommendations, the study and the outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.explore.process import run_probe
from batchpilot.explore.recommend import Recommendation, Topology, plan_notes, recommend
from batchpilot.explore.records import (
    ProbeLayout,
    ProbeRequest,
    ProbeResult,
    Setting,
    factory_errors,
    probe_layout,
)
from batchpilot.explore.report import write_outputs
from batchpilot.explore.result import SINGLE_PROCESS, ExploreResult
from batchpilot.explore.search import Candidate, SearchState, next_probe
from batchpilot.explore.study import (
    NoiseScaleReport,
    StudyRequest,
    advise,
    format_samples,
    run_study,
    weights_of,
)
from batchpilot.storage import open_storage
from batchpilot.threads import local_trainer_threads

logger = logging.getLogger(__name__)

Measure = Callable[[ProbeRequest], ProbeResult]


def probe_request(
    *,
    config: Config,
    micro_batch_size: int,
    setting: Setting,
    reference: ProbeResult | None = None,
    layout: ProbeLayout = SINGLE_PROCESS,
) -> ProbeRequest:
    """The probe of one configuration on the config's model and real data, run as `layout` says.

    `reference` (the base probe) is timed next to every pass when it is another configuration, not
    compiled (neither is the probe) and not larger than the probe (so it cannot raise its peak memory).
    """
    explore = config.explore
    paired = (
        reference
        if reference is not None
        and not reference.compile
        and not setting.compile
        and reference.micro_batch_size <= micro_batch_size
        and (reference.micro_batch_size, reference.setting) != (micro_batch_size, setting)
        else None
    )
    return ProbeRequest(
        factory=config.model.factory,
        model_args=dict(config.model.args),
        data_uri=config.data.uri,
        split=config.data.split,
        seq_len=config.data.seq_len,
        seed=config.train.seed,
        verify_checksums=config.data.verify_checksums,
        micro_batch_size=micro_batch_size,
        activation_checkpointing=setting.activation_checkpointing,
        compile=setting.compile,
        warmup_steps=explore.warmup_steps,
        timed_steps=explore.timed_steps,
        min_timed_s=explore.min_timed_s,
        memory_budget_bytes=explore.memory_budget_bytes,
        precision=config.train.precision,
        cpu_threads=local_trainer_threads() if config.cluster.backend == "local" else None,
        reference_micro_batch_size=paired.micro_batch_size if paired else None,
        reference_activation_checkpointing=paired.activation_checkpointing if paired else False,
        parallelism=layout.parallelism,
        processes=layout.processes,
        tensor_parallel_size=layout.tensor_parallel_size,
    )


def layout_of(config: Config) -> ProbeLayout:
    """How this exploration's probes run: the strategy the stages will run (`planner.probe_parallelism`,
    from the model's meta-device shape), and the processes of one node under fsdp/hsdp."""
    from batchpilot.plan.memory import probe_parallelism
    from batchpilot.train.shape import model_shape

    with factory_errors(config.model.factory):
        shape = model_shape(factory=config.model.factory, args=dict(config.model.args))
    layout = probe_layout(
        parallelism=probe_parallelism(config, shape),
        devices_per_node=config.cluster.devices_per_node,
        tensor_parallel_size=config.train.tensor_parallel_size,
    )
    check_devices(layout)
    return layout


def check_devices(layout: ProbeLayout) -> None:
    """A multi-process probe on a GPU machine needs a GPU per process (on CPU, any count runs on gloo)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and layout.processes > gpus:
        raise BatchpilotError(
            "cluster.devices_per_node",
            f"probes under {layout.parallelism} run {layout.processes} processes, one per GPU, and this "
            f"machine has {gpus}",
            "run explore on a node of the cluster's accelerator type",
        )


def on_gpu(config: Config) -> bool:
    """Whether explore's probes run on the pool's GPU (else on the CPU, under explore.memory_budget_bytes)."""
    from batchpilot.train.accelerators import planned_gpu

    return planned_gpu(accelerator_type=config.cluster.accelerator_type)


def check_accelerator(config: Config) -> None:
    """A gke GPU config's explore measures the pool's GPU, never the CPU: without a GPU it refuses in one
    line before any probe (the pipeline's explore task gets one GPU of the pool, `nvidia.com/gpu: 1`)."""
    from batchpilot.train.accelerators import require_cuda

    cluster = config.cluster
    if on_gpu(config):
        assert cluster.accelerator_type is not None
        require_cuda(
            accelerator_type=cluster.accelerator_type,
            num_devices_needed=1,
            needed_by="explore's probes measure one GPU",
        )


def settings_of(config: Config) -> list[Setting]:
    """Activation checkpointing x compile, in the config's order (the first is searched from 1)."""
    return [
        Setting(activation_checkpointing=ac, compile=compiled)
        for compiled, ac in itertools.product(
            dict.fromkeys(config.explore.compile), dict.fromkeys(config.explore.activation_checkpointing)
        )
    ]


def check_dataset(uri: str) -> None:
    """A missing dataset is one clear error before any probe (never synthetic data)."""
    storage = open_storage(uri)
    if not storage.exists("manifest.json"):
        raise BatchpilotError(
            "data.uri",
            f"{uri} holds no shard set (no manifest.json), and explore measures on real data",
            f"run: batchpilot data prepare ... --out {uri} (or --demo for the demo set)",
        )


def describe(result: ProbeResult) -> str:
    """`micro_batch_size=8, activation checkpointing off: fits, peak 331 MiB, 19.3 ms/pass, 52,925 tokens/s,
    2.31x the base pass by pass`."""
    head = f"micro_batch_size={result.micro_batch_size}, {result.setting.label()}"
    peak = f"peak {result.peak_memory_bytes / 2**20:,.0f} MiB" if result.peak_memory_bytes else "peak unknown"
    if result.fits and result.step_time_s and result.tokens_per_s:
        paired = (
            f", {result.relative_throughput:.2f}x the base pass by pass"
            if result.relative_throughput is not None
            else ""
        )
        return (
            f"{head}: fits, {peak}, {result.step_time_s * 1000:,.1f} ms/pass, "
            f"{result.tokens_per_s:,.0f} tokens/s{paired}"
        )
    return f"{head}: does not fit ({result.error}; {peak})"


def _fail_at_smallest(state: SearchState, budget_bytes: int) -> BatchpilotError:
    """The error when no setting fits even the smallest size: the budget, or a broken model/factory."""
    failures = [r for r in state.results if not r.fits]
    over = [r for r in failures if r.error and "memory" in r.error]
    if over and len(over) == len(failures):
        needed = min(r.peak_memory_bytes or 0 for r in over)
        return BatchpilotError(
            "explore.memory_budget_bytes",
            f"no setting fits even micro_batch_size={min(r.micro_batch_size for r in over)} within "
            f"{budget_bytes:,} bytes (a probe reached {needed:,})",
            "raise the budget, or use a smaller model",
        )
    first = failures[0] if failures else None
    reason = first.error if first else "no probe ran"
    return BatchpilotError(
        "model.factory",
        f"the model could not train even at micro_batch_size={first.micro_batch_size if first else 1}: {reason}",
        "check that model.factory builds a model whose forward takes token ids [batch, seq] and returns logits",
    )


def _user_error(line: str) -> BatchpilotError:
    """A probe's one-line user error (`field: problem (fix: ...)`) as the same BatchpilotError."""
    field, _, rest = line.partition(": ")
    problem, _, fix = (
        rest.rpartition(" (fix: ") if rest.endswith(")") and " (fix: " in rest else (rest, "", "")
    )
    return BatchpilotError(field, problem, fix[:-1] if fix else None)


def _explicit_candidates(state: SearchState, sizes: Sequence[int]) -> Candidate | None:
    """The next (setting, size) of an explicit sweep; sizes above one that did not fit are skipped."""
    for setting in state.settings:
        limit = state.smallest_not_fitting(setting)
        for micro in sizes:
            if (limit is None or micro < limit) and not state.probed(setting, micro):
                return Candidate(setting, micro, "sweep")
    return None


def usable_bound(config: Config) -> int:
    """The largest micro batch the search may probe without `explore.max_micro_batch_size`: the largest a
    plan of this config can use (`plan.schedule.largest_usable_micro_batch`), else the target batch."""
    from batchpilot.plan.schedule import largest_usable_micro_batch

    usable = largest_usable_micro_batch(config)
    if usable is not None and usable < config.batch.target_bound:
        logger.info(
            "explore: micro batches up to %d (the largest every stage of this plan splits into; "
            "explore.max_micro_batch_size overrides)", usable,
        )  # fmt: skip
        return usable
    return config.batch.target_bound


def search_micro_batch(
    *,
    config: Config,
    max_probes: int,
    max_minutes: float,
    micro_batch_sizes: Sequence[int] | None,
    measure: Measure,
    layout: ProbeLayout = SINGLE_PROCESS,
) -> tuple[SearchState, Recommendation, str]:
    """Probes until the search converges or a budget runs out; logs each probe and recommendation."""
    explore = config.explore
    state = SearchState(
        settings=settings_of(config),
        max_micro_batch_size=explore.max_micro_batch_size or usable_bound(config),
        seq_len=config.data.seq_len,
        # on the CPU a probe fits while its resident peak stays within the budget; a GPU's limit is its own
        memory_budget_bytes=None if on_gpu(config) else explore.memory_budget_bytes,
    )
    deadline_s = time.monotonic() + max_minutes * 60
    stopped = "max_probes"
    while len(state.results) < max_probes:
        if time.monotonic() > deadline_s:
            stopped = "max_minutes"
            break
        candidate = _explicit_candidates(state, micro_batch_sizes) if micro_batch_sizes else next_probe(state)
        if candidate is None:
            stopped = "converged" if not micro_batch_sizes else "swept"
            break
        result = measure(
            probe_request(
                config=config,
                micro_batch_size=candidate.micro_batch_size,
                setting=candidate.setting,
                reference=state.base(),
                layout=layout,
            )
        )
        if result.user_error:
            raise _user_error(result.user_error)
        state.add(result)
        logger.info("probe %d/%d (%s): %s", len(state.results), max_probes, candidate.phase, describe(result))
        current = recommend(state)
        if current is not None:
            logger.info(current.line())
    recommendation = recommend(state)
    if recommendation is None:
        raise _fail_at_smallest(state, explore.memory_budget_bytes)
    return state, recommendation, stopped


def _study(*, config: Config, recommendation: Recommendation, layout: ProbeLayout) -> NoiseScaleReport:
    explore = config.explore
    micro = recommendation.micro_batch_size
    multipliers = list(explore.accumulation_multipliers)
    logger.info(
        "effective-batch study at micro_batch_size=%d: accumulating %s after %d training step(s)",
        micro, ", ".join(f"{k}x" for k in multipliers), explore.study_train_steps,
    )  # fmt: skip
    setting = Setting(recommendation.activation_checkpointing, recommendation.compile)
    # The noise scale is the model's own: a continued pretraining's starts from train.init_from's weights.
    probe = probe_request(config=config, micro_batch_size=micro, setting=setting, layout=layout)
    weights = weights_of(config.train.init_from)
    logger.info("the study's model starts from %s", weights)
    request = StudyRequest(
        probe=replace(probe, init_from=config.train.init_from),
        multipliers=multipliers,
        measure_batches=explore.study_measure_batches,
        train_steps=explore.study_train_steps,
        lr=config.train.lr,
    )
    per_multiplier = run_study(request=request, timeout_s=explore.study_timeout_s)
    for row in per_multiplier:
        noise = format_samples(row.noise_scale) if row.noise_scale else "not measurable"
        logger.info(
            "  %2dx (global batch %d): noise scale %s, gradient norm %.4f, coherence %.3f",
            row.multiplier, row.global_batch_size, noise, row.grad_norm, row.coherence,
        )  # fmt: skip
    return advise(
        per_multiplier=per_multiplier,
        micro_batch_size=micro,
        configured_global_batch_size=config.batch.target_bound,
        # data-parallel ranks: a tensor-parallel group takes one micro batch
        devices_per_node=config.cluster.devices_per_node // layout.tensor_parallel_size,
        min_nodes=config.cluster.min_nodes,
        max_nodes=config.cluster.max_nodes,
        train_steps=explore.study_train_steps,
        processes=layout.processes // layout.tensor_parallel_size,
        weights=weights,
    )


def _check_inputs(
    *, config: Config, max_probes: int, max_minutes: float, sizes: Sequence[int] | None
) -> None:
    if max_probes <= 0:
        raise BatchpilotError("--max-probes", f"must be positive, got {max_probes}")
    if max_minutes <= 0:
        raise BatchpilotError("--max-minutes", f"must be positive, got {max_minutes}")
    if sizes is not None and (not sizes or min(sizes) <= 0):
        raise BatchpilotError("--micro-batch-sizes", f"must be positive integers, got {list(sizes)}")
    if any(k < 2 for k in config.explore.accumulation_multipliers):
        raise BatchpilotError(
            "explore.accumulation_multipliers",
            f"{config.explore.accumulation_multipliers} has a value below 2; the noise scale compares two batch sizes",
            "use multipliers of at least 2, e.g. [2, 4, 8, 16]",
        )
    check_dataset(config.data.uri)


def run_exploration(
    *,
    config: Config,
    output_dir: Path,
    max_probes: int | None = None,
    max_minutes: float | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    study: bool = True,
    measure: Measure | None = None,
) -> ExploreResult:
    """Finds the fastest micro batch that fits one device, studies the effective batch, writes the outputs.

    Args:
        config: the validated config (model, data, batch and cluster for the plan notes, explore budgets).
        output_dir: explore.json, explore.html and explore_metrics.json are written here, atomically.
        max_probes, max_minutes: override explore.max_probes / explore.max_minutes.
        micro_batch_sizes: probe exactly these sizes for every setting (an exhaustive sweep) instead of
            searching; sizes above one that does not fit are skipped.
        study: run the effective-batch study (noise_scale is None without it).
        measure: runs one probe (default: a fresh process with explore.probe_timeout_s).

    Every probe, interim recommendation and study row is logged at INFO (`batchpilot.explore.runner`).

    Raises:
        BatchpilotError: a gke GPU config without a GPU here, a missing dataset, a train.init_from that does
            not fit the model (with the study), a broken model factory, a budget nothing fits in, a failed
            study.
    """

    started = time.monotonic()
    check_accelerator(config)
    probes = max_probes if max_probes is not None else config.explore.max_probes
    minutes = max_minutes if max_minutes is not None else config.explore.max_minutes
    _check_inputs(config=config, max_probes=probes, max_minutes=minutes, sizes=micro_batch_sizes)
    if study and config.train.init_from is not None:
        from batchpilot.plan.init_from import init_from_problems
        from batchpilot.planning.batch import raise_problems

        # As `plan` does, before any probe (under train.parallelism auto, layout_of's plan checks it too).
        raise_problems(init_from_problems(config))
    timeout_s = config.explore.probe_timeout_s
    layout = layout_of(config)
    logger.info(layout.line())
    state, recommendation, stopped = search_micro_batch(
        config=config,
        max_probes=probes,
        max_minutes=minutes,
        micro_batch_sizes=sorted(set(micro_batch_sizes)) if micro_batch_sizes else None,
        measure=measure or (lambda request: run_probe(request=request, timeout_s=timeout_s)),
        layout=layout,
    )
    plan_notes(recommendation=recommendation, state=state, topology=topology_of(config))
    noise, study_error = None, None
    if study:
        try:
            noise = _study(config=config, recommendation=recommendation, layout=layout)
        except BatchpilotError as error:
            study_error = error
    result = ExploreResult(
        probes=state.results,
        recommendation=recommendation,
        noise_scale=noise,
        output_dir=output_dir,
        elapsed_s=time.monotonic() - started,
        stopped_because=stopped,
        layout=layout,
    )
    write_outputs(
        result=result, state=state, config=config, study_error=str(study_error) if study_error else None
    )
    if study_error is not None:
        raise study_error
    return result


def plan_error(config: Config, micro_batch_size: int) -> str | None:
    """Why the config's ramp-up cannot use this micro batch (None: every stage fits)."""
    from batchpilot.plan.stages import build_plan

    try:
        build_plan(config, micro_batch_size=micro_batch_size)
    except BatchpilotError as error:
        return str(error)
    return None


def topology_of(config: Config) -> Topology:
    return Topology(
        stage_error=lambda micro: plan_error(config, micro),
        global_batch_size=config.batch.target_bound,
        devices_per_node=config.cluster.devices_per_node,
        min_nodes=config.cluster.min_nodes,
        max_nodes=config.cluster.max_nodes,
        pipeline_parallel_size=config.batch.pipeline_parallel_size,
        tensor_parallel_size=config.train.tensor_parallel_size,
    )
