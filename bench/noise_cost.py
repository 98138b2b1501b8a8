"""What measuring the gradient noise scale from the ranks' own gradients costs a step (#38, target <= 2%).

Two CPU processes with gloo (one thread each) train the trainer_overhead model (GPT 2x128, fp32) under fsdp
through the trainer's own passes (`accumulate_gradients`, whose reduce-scatters read each rank's gradient
norm while measuring), then clip, AdamW and one host read of the loss and the small-batch norm, as the
trainer's step. Each process alternates steps with the measurement on and off (`measure_noise`), in
`--pairs` pairs of neighbouring steps (the order alternating from pair to pair), so both see the machine in
the same state; a row prints the median step time of each and the median of the pairs' ratios (measured /
not) with their quartiles, at accumulation 1 (micro 16 x 2 ranks) and 2 (micro 8 x 2 x 2). Before #38 a
step at accumulation 1 measured by running its micro-batch as two halves (one more pass of all-gathers and
reduce-scatters); the `halves` row times that step for comparison.

`reads / measured step` is the time the reduce-scatters' norm reads took (timed inside the step: on the CPU
they run in the backward's thread) over the measured step's median: the measurement's own cost, free of the
pairs' noise (steps on a shared 2-core machine scatter by +-6%, so the pairs' median resolves about 1%).

Run: .venv/bin/python bench/noise_cost.py [--pairs 200]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpilot.models.gpt import build
from batchpilot.train.parallel import LocalGradientNorms, wrap_model
from batchpilot.train.step import accumulate_gradients
from local_ranks import free_port, join

MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257}
SEQ_LEN, WORLD, WARMUP = 128, 2, 3
ROWS = (("accumulation 1", 16, 1, False), ("accumulation 2", 8, 2, False), ("halves", 16, 1, True))
TARGET = 0.02


def _step(model, parallel, ctx, optimizer, batches, measure: bool) -> None:
    outcome = accumulate_gradients(
        model=model, parallel=parallel, micro_batches=batches, ctx=ctx, autocast=contextlib.nullcontext,
        measure_noise=measure, measure_coherence=False,
    )  # fmt: skip
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    small = (
        outcome.small_sq_norm if outcome.small_sq_norm is not None else torch.zeros((), dtype=torch.float64)
    )
    ctx.mean([float(outcome.loss), float(small)])  # the step's one host read, as read_step's


def _batches(generator: torch.Generator, micro: int, accumulation: int, split: int) -> list[torch.Tensor]:
    """One step's micro-batches of this rank (`split` 2: each as two halves)."""
    rows = torch.randint(0, MODEL["vocab_size"], (micro * accumulation, SEQ_LEN + 1), generator=generator)
    return list(rows.chunk(accumulation * split))


def _timed_reads(norms: LocalGradientNorms) -> list[float]:
    """Wraps `norms.read` (the reduce-scatter's norm of its input) to add up its seconds in the returned
    list's one item: on the CPU the read runs in the backward's thread, so this is what it adds to a step."""
    total = [0.0]
    read = norms.read

    def timed(*args, **kwargs) -> None:
        started = time.perf_counter()
        read(*args, **kwargs)
        total[0] += time.perf_counter() - started

    norms.read = timed  # type: ignore[method-assign]
    return total


def _worker(rank: int, port: int, out: str, pairs: int) -> None:
    ctx = join(rank, WORLD, port)
    torch.manual_seed(0)
    model = build(**MODEL)
    parallel = wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=lambda m: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    results = {}
    local_norms = parallel.local_norms
    assert local_norms is not None
    reading = _timed_reads(local_norms)
    for name, micro, accumulation, halves in ROWS:
        for _ in range(WARMUP):
            _step(model, parallel, ctx, optimizer, _batches(generator, micro, accumulation, 1), True)
        # `halves`: the step before #38, its micro-batch split in two and the first half's gradient read over
        # all ranks (the reduce-scatter read off), against the unsplit unmeasured step.
        parallel.local_norms = None if halves else local_norms
        times: dict[bool, list[float]] = {True: [], False: []}
        reading[0] = 0.0
        for index in range(pairs):
            for measure in (index % 2 == 0, index % 2 == 1):  # the order alternates from pair to pair
                batches = _batches(generator, micro, accumulation, 2 if halves and measure else 1)
                started = time.perf_counter()
                _step(model, parallel, ctx, optimizer, batches, measure)
                times[measure].append(time.perf_counter() - started)
        results[name] = {**times, "reading": reading[0] / pairs}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs",
        type=int,
        default=120,
        help="pairs of neighbouring steps, one measured and one not, per row",
    )
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.spawn(_worker, args=(port, out, args.pairs), nprocs=WORLD, join=True)
        results = torch.load(out)
    print(
        f"fsdp, {WORLD} CPU processes (gloo, 1 thread each), GPT {MODEL['n_layer']}x{MODEL['n_embd']} fp32, seq_len {SEQ_LEN}"
    )
    print(
        f"{'row':<16}| {'measured ms/step':>16} | {'not measured ms/step':>20} | "
        "ratio: median of the pairs' [quartiles] | reads / measured step"
    )
    for name, micro, accumulation, halves in ROWS:
        on, off = results[name][True], results[name][False]
        ratios = sorted(a / b for a, b in zip(on, off, strict=True))  # each pair of neighbouring steps
        ratio, quartiles = statistics.median(ratios), statistics.quantiles(ratios, n=4)
        how = f"micro {micro // 2 if halves else micro} x {WORLD} x {2 if halves else accumulation}"
        read = results[name]["reading"] / statistics.median(on)
        verdict = "" if halves else ("  ok" if read <= TARGET else "  ABOVE TARGET")
        print(
            f"{name:<16}| {statistics.median(on) * 1000:16.1f} | {statistics.median(off) * 1000:20.1f} | "
            f"{ratio:.3f} [{quartiles[0]:.3f}..{quartiles[2]:.3f}] | "
            + ("-" if halves else f"{read:.4f}{verdict}")
            + f"  ({how})"
        )
    print(
        f"target: reads / measured step <= {TARGET} (the ratio column checks it within the pairs' noise; the "
        "`halves` row: the step as it measured before #38)"
    )


if __name__ == "__main__":
    main()
