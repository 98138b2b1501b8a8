"""A realistic finished run without training one: the demo config's plan at micro batch 16 (stages 16, 32, 48 on
one node, the final 64 on two), one metrics record per optimizer step, and an explore.json whose fastest size (48)
is not the one the plan could take (16). The report's unit tests and its browser test render from these."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchpilot.config import config_from_text
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.cost import estimate_cost
from batchpilot.workflow.plan import plan
from helpers import REPO

STEP_TIME_S = 0.5
SAMPLES_PER_S_PER_DEVICE = 64.0
WALL_START = 1_790_000_000.0
STAGE_GAP_S = 30.0
"""Wall-clock seconds between one stage's last step and the next one's first (a launch, a resize)."""


def sample_document() -> RunDocument:
    """The demo plan at micro batch 16, taken from explore (48 was its fastest), with a cost estimate."""
    document = plan(config_from_text((REPO / "configs" / "demo.yaml").read_text()), micro_batch_size=16)
    return dataclasses.replace(
        document,
        micro_batch_source="explore",
        cost=estimate_cost(document.plan, samples_per_s_per_device=SAMPLES_PER_S_PER_DEVICE),
    )


TRIAL_LOSSES = {
    # (batch, LR multiplier): validation loss at 64, 128, 192 and 256 samples after the warm-up.
    (16, 0.5): [4.2, 3.9, 3.7, 3.60],
    (16, 1.0): [4.1, 3.8, 3.6, 3.50],  # the best at 16
    (16, 2.0): [4.1, 3.85, 3.65, 3.55],
    (32, 0.5): [4.3, 4.0, 3.8, 3.70],
    (32, 1.0): [4.2, 3.9, 3.7, 3.58],
    (32, 2.0): [4.15, 3.85, 3.6, 3.52],  # the best at 32: within 1% of 3.50
    (64, 0.5): [4.5, 4.2, 4.0, 3.90],
    (64, 1.0): [4.4, 4.1, 3.9, 3.75],  # the best at 64: 7% above 3.50, the scan ends
}
"""The trials' branches that trained; batch 64 at LR x 2 ran out of memory."""


def sample_trials_document() -> RunDocument:
    """The sample run with batch trials decided: the demo's 9 branches (batches 16, 32, 64 x LR 0.5, 1, 2)
    after a 1,024-sample warm-up, 256 samples each; the critical batch is 32 at LR x 2."""
    from batchpilot.planning.trials import BranchResult, TrialsOutcome, decide

    config = (REPO / "configs" / "demo.yaml").read_text() + "trials: {enabled: true, tokens: 32768}\n"
    trials = plan(config_from_text(config), micro_batch_size=16, announce=False).trials
    assert trials is not None
    results = tuple(
        BranchResult(
            b.index,
            b.global_batch_size,
            b.lr_multiplier,
            "ok",
            tuple(zip(trials.eval_points, losses, strict=True)),
        )
        if (losses := TRIAL_LOSSES.get((b.global_batch_size, b.lr_multiplier)))
        else BranchResult(
            b.index, b.global_batch_size, b.lr_multiplier, "failed", reason="CUDA out of memory"
        )
        for b in trials.branches
    )
    outcome = TrialsOutcome(results, decide(results, tolerance=trials.tolerance), noise_scale_at_start=8.0)
    return dataclasses.replace(sample_document(), trials=trials, trials_outcome=outcome)


def sample_records(document: RunDocument, *, validation_every: int | None = 40) -> list[dict[str, Any]]:
    """One record per optimizer step: the loss falls by 0.01 a step from 5.0, each step takes 0.5 s and 30 s pass between
    stages (`time`, the wall clock at each step's end), the noise
    scale grows with the samples; `val_loss` every `validation_every` steps (null on the others), or no such
    key at all (a run from before validation)."""
    steps = [
        (stage, consumed)
        for stage in document.plan.stages
        for consumed in range(
            stage.start_sample + stage.global_batch_size, stage.end_sample + 1, stage.global_batch_size
        )
    ]
    rows: list[dict[str, Any]] = []
    clock = WALL_START
    for index, (stage, consumed) in enumerate(steps):
        if index and stage.index != steps[index - 1][0].index:
            clock += STAGE_GAP_S
        clock += STEP_TIME_S
        row: dict[str, Any] = {
            "step": index + 1,
            "consumed_samples": consumed,
            "stage": stage.index,
            "global_batch_size": stage.global_batch_size,
            "micro_batch_size": stage.micro_batch_size,
            "gradient_accumulation_steps": stage.gradient_accumulation_steps,
            "world_size": stage.world_size,
            "loss": 5.0 - index / 100,
            "lr": stage.lr,
            "grad_norm": 1.0,
            "tokens_per_s": stage.global_batch_size * 128 / STEP_TIME_S,
            "mfu": None,
            "step_time_s": STEP_TIME_S,
            "peak_memory_bytes": 400 * 2**20,
            "noise_scale": 4.0 + consumed / 1000 if index % 5 == 4 else None,
            "time": clock,
        }
        if validation_every is not None:
            row["val_loss"] = 5.5 - index / 100 if (index + 1) % validation_every == 0 else None
        rows.append(row)
    return rows


def _probe(
    micro: int, ratio: float | None, *, checkpointing: bool = False, fits: bool = True
) -> dict[str, Any]:
    tokens_per_s = 30_000.0 * (ratio or 1.0)
    return {
        "micro_batch_size": micro,
        "activation_checkpointing": checkpointing,
        "compile": False,
        "fits": fits,
        "peak_memory_bytes": (330 + micro) * 2**20 if fits else None,
        "step_time_s": micro * 128 / tokens_per_s if fits else None,
        "tokens_per_s": tokens_per_s if fits else None,
        "samples_per_s": tokens_per_s / 128 if fits else None,
        "repeats": max(3, 64 // micro),
        "error": None if fits else "out of memory",
        "device": "cpu",
        "duration_s": 3.0,
        "step_times_s": [],
        "pair_ratios": [],
        "relative_throughput": ratio,
    }


def sample_explore(*, study_train_steps: int = 50, critical_batch_size: float = 0.32) -> dict[str, Any]:
    """An explore.json: sizes 1 to 64 (48 the fastest, 16 at 1.5x the base and 48 at 2.0x, 48 measured twice),
    the recommendation 48 with 16 the plan's size, and the effective-batch study."""
    probes = [
        _probe(1, None),
        _probe(2, 1.2),
        _probe(4, 1.35),
        _probe(8, 1.45),
        _probe(16, 1.5),
        _probe(32, 1.9),
    ]
    probes += [_probe(64, 1.7), _probe(64, 1.4, checkpointing=True), _probe(48, 2.0), _probe(48, 2.0)]
    return {
        "format_version": 1,
        "name": "demo",
        "device": "cpu",
        "probe_parallelism": "ddp",
        "processes_per_probe": 1,
        "seq_len": 128,
        "memory_budget_bytes": 2**31,
        "stopped_because": "max_probes",
        "elapsed_s": 58.4,
        "probes": probes,
        "frontier": [],
        "recommendation": {
            "micro_batch_size": 48,
            "activation_checkpointing": False,
            "compile": False,
            "estimated_speedup": 2.0,
            "confidence": 57,
            "samples_per_s": 468.75,
            "tokens_per_s": 60_000.0,
            "peak_memory_bytes": 378 * 2**20,
            "base_micro_batch_size": 1,
            "reasoning": ["fastest of 9 fitting measured sizes: 60,000 tokens/s at micro_batch_size=48"],
            "plan_notes": ["micro_batch_size=48 does not divide global_batch_size 64 / data_parallel_size 2"],
            "plan_compatible_micro_batch_size": 16,
            "plan_compatible_activation_checkpointing": False,
            "plan_compatible_compile": False,
        },
        "noise_scale": {
            "critical_batch_size": critical_batch_size,
            "per_multiplier": [
                {
                    "multiplier": k,
                    "global_batch_size": 48 * k,
                    "noise_scale": critical_batch_size,
                    "g2": 5.8,
                    "s": 1.4,
                    "grad_norm": 2.4163333924442103,
                    "coherence": 0.9958603788063118,
                }
                for k in (2, 4)
            ],
            "recommended_global_batch_size": 48,
            "lr_scaling": "none",
            "reasoning": ["critical batch size (B_simple) measured at micro_batch_size=48"],
            "micro_batch_size": 48,
            "train_steps": study_train_steps,
            "processes": 1,
        },
        "study_error": None,
    }


def sample_canary(*, started_at: float | None = None, finished_at: float | None = None) -> dict[str, Any]:
    """A canary.json of a passed 2-node gloo canary; `started_at`/`finished_at` as the canary records them
    (None: left out, as a canary.json from before they were recorded)."""
    canary: dict[str, Any] = {
        "num_nodes": 2, "processes_per_node": 1, "world_size": 2, "backend": "gloo", "machine_type": None,
        "all_reduce_bytes": 4 * 2**20, "all_reduce_time_s": 0.004, "bus_bandwidth_bytes_per_s": 1.09e9,
        "expected_bus_bandwidth_bytes_per_s": None, "bandwidth_problem": None, "nccl_version": None,
        "nccl_networks": [], "transport_problem": None,
        "nodes": [
            {"node": n, "host": "vm", "devices": 0, "processes": 1, "read_bytes": 4 * 2**20,
             "read_mb_per_s": 600.0, "checkpoint_write_ms": 2.5, "checkpoint_read_ms": 0.1}
            for n in (0, 1)
        ],
    }  # fmt: skip
    if started_at is not None:
        canary["started_at"] = started_at
    if finished_at is not None:
        canary["finished_at"] = finished_at
    return canary
