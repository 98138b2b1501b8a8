"""The loop's records: a step's metrics record, its progress line, the stage summary, and the audit of the
sample positions each data-parallel rank trained."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from batchpilot.data.sampling import rank_micro_batches
from batchpilot.planning import Plan, Stage


def step_record(
    *,
    step: int,
    consumed: int,
    stage: Stage,
    micro: int,
    accumulation: int,
    world_size: int,
    loss: float,
    lr: float,
    grad_norm: float,
    step_time_s: float,
    seq_len: int,
    flops_per_token: float,
    peak_flops: float | None,
    peak_memory_bytes: int,
    noise_scale: float | None,
    coherence: float | None,
    val_loss: float | None,
) -> dict[str, Any]:
    """One metrics.jsonl line: the step's batch arithmetic, loss, LR, throughput, MFU and measurements."""
    tokens_per_s = stage.global_batch_size * seq_len / step_time_s
    mfu = tokens_per_s * flops_per_token / (peak_flops * world_size) if peak_flops else None
    return {
        "step": step,
        "consumed_samples": consumed,
        "stage": stage.index,
        "global_batch_size": stage.global_batch_size,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "world_size": world_size,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "step_time_s": step_time_s,
        "peak_memory_bytes": peak_memory_bytes,
        "noise_scale": noise_scale,
        "gradient_coherence": coherence,
        "val_loss": val_loss,
    }


def progress_line(stage: Stage, record: dict[str, Any], *, world: str) -> str:
    """`stage-1 step 12 | samples ... | batch 32 = 8 x <world> x 2 | loss ... | lr ... | tok/s ...`."""
    extra = f" | noise scale {record['noise_scale']:,.0f}" if record["noise_scale"] else ""
    extra += f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
    extra += f" | val loss {record['val_loss']:.4f}" if record["val_loss"] is not None else ""
    return (
        f"{stage.name} step {record['step']} | samples {record['consumed_samples']:,}/{stage.end_sample:,} | "
        f"batch {stage.global_batch_size} = {record['micro_batch_size']} x {world} x "
        f"{record['gradient_accumulation_steps']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"{record['tokens_per_s']:,.0f} tok/s{extra}"
    )


def stage_done_line(plan: Plan, stage: Stage, *, step: int) -> str:
    """The stage's summary, naming the next stage and its node count."""
    following = [s for s in plan.stages if s.index == stage.index + 1]
    then = (
        f"; next: {following[0].name} on {following[0].num_nodes} node(s)"
        if following
        else "; training complete"
    )
    return (
        f"{stage.name} done: samples [{stage.start_sample:,}, {stage.end_sample:,}) at global batch "
        f"{stage.global_batch_size}, {step} optimizer steps so far{then}"
    )


def append_audit(
    audit_dir: Path, stage: Stage, *, consumed: int, micro: int, world_size: int, ranks: Iterable[int]
) -> None:
    """Appends the sample positions each of `ranks` trains in this step to `positions-rank<r>.txt`."""
    for rank in ranks:
        positions = rank_micro_batches(
            consumed_samples=consumed,
            global_batch_size=stage.global_batch_size,
            micro_batch_size=micro,
            data_parallel_size=world_size,
            data_parallel_rank=rank,
        )
        line = " ".join(str(p) for r in positions for p in r)
        with (audit_dir / f"positions-rank{rank}.txt").open("a") as file:
            file.write(f"{stage.index} {world_size} {line}\n")
