"""Trainer throughput against a bare PyTorch loop: same model, batch, accumulation, in the same run.

Rows (`--rows`):
- `single`: one process, no process group; the trainer runs in this process (`train()`), the bare loop
  too, on CUDA when there is a GPU (bf16 autocast), else on the CPU with the process's default threads.
- `fsdp`: two CPU processes with gloo under torchrun, one thread each (OMP_NUM_THREADS=1 on both sides):
  the trainer as `batchpilot train` with `train.parallelism: fsdp`, the bare loop as this file's worker
  mode, which applies `fully_shard` to the same units as the trainer (`shard_units`: the embeddings, each
  block, the final norm with the head; one unit for the tied GPT's embedding and head) then the root.

Both sides time `steps` optimizer steps after WARMUP_STEPS untimed ones, inside one run: the trainer from
the end of its warm-up steps to the end of its last (each step's end recorded by wrapping the loop's
`_finish_step`, so start-up, data opening and the final checkpoint stay out), the bare loop likewise; both
with the same model, AdamW, micro-batches per rank, accumulation, clipping and loss (the bare loop's
micro-batches from memory). A shared machine's load drifts by more than the overhead being measured, so
the two are measured in pairs, back to back (the order alternating between pairs; the single row on the
CPU in the process's CPU seconds, which others' work inflates far less), and each row prints
the median of the per-pair throughput ratios bare/trainer with their range (target >= 0.95, i.e. the
trainer's overhead is at most 5%).

Run: .venv/bin/python bench/trainer_overhead.py [--rows single,fsdp] [--steps 20] [--pairs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

from batchpilot.cli import main as cli_main
from batchpilot.config import Config, parse_config
from batchpilot.models.factory import build_model, compile_model
from batchpilot.plan.planner import make_run_document
from batchpilot.plan.stages import build_plan
from batchpilot.train.eager import autocast_factory
from batchpilot.train.loop import TrainingLoop
from batchpilot.train.parallel import shard_units
from batchpilot.train.setup import make_optimizer
from batchpilot.train.shape import model_shape
from batchpilot.train.trainer import train

FACTORY = "batchpilot.models.gpt:build"
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257}
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 32, 8, 128
LR, WEIGHT_DECAY, GRAD_CLIP = 3e-4, 0.1, 1.0
WARMUP_STEPS = 5
FSDP_WORLD = 2
ROWS = ("single", "fsdp")
TARGET_RATIO = 0.95


@dataclass(frozen=True)
class Setup:
    """The model and batch both loops train (bench/gpu_mfu.py measures a larger one on a GPU)."""

    model: dict[str, int]
    global_batch: int
    micro_batch: int
    seq_len: int
    factory: str = FACTORY
    compile: bool = False
    """train.compile on both sides (compile_model: each block)."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def accumulation(self, world_size: int) -> int:
        return self.global_batch // (self.micro_batch * world_size)


CPU_SETUP = Setup(MODEL, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN)


def config_for(
    setup: Setup,
    root: Path,
    data_uri: str,
    steps: int,
    run: str,
    *,
    world_size: int = 1,
    parallelism: str = "auto",
) -> Config:
    return parse_config(
        {
            "name": "bench",
            "model": {"factory": setup.factory, "args": setup.model},
            "data": {"uri": data_uri, "seq_len": setup.seq_len},
            "cluster": {"devices_per_node": world_size, "max_nodes": 1},
            "batch": {"global_batch_size": setup.global_batch, "micro_batch_size": setup.micro_batch},
            "train": {
                "total_samples": steps * setup.global_batch,
                "lr": LR,
                "weight_decay": WEIGHT_DECAY,
                "grad_clip": GRAD_CLIP,
                "parallelism": parallelism,
                "checkpoint_uri": f"file://{root}/{run}/ckpt",
                "checkpoint_every_s": 0,
                "eval_samples": 0,  # the stage-end validation would land in the last timed step
                "compile": setup.compile,
            },
        }
    )


# --- the trainer ------------------------------------------------------------------------------------


def single_row_clock() -> Callable[[], float]:
    """The single row's clock: wall time on a GPU; on the CPU the process's CPU time (every thread's,
    the trainer's prefetch thread included), which other work on a shared machine inflates far less than
    wall time. It leaves out time spent waiting (a stall for data would not show: the fsdp row, timed in
    wall seconds, would show it)."""
    return time.perf_counter if torch.cuda.is_available() else time.process_time


@contextlib.contextmanager
def step_ends(clock: Callable[[], float] = time.perf_counter) -> Iterator[list[float]]:
    """A list that gets `clock()` each time the trainer finishes an optimizer step (after its metrics
    line), so the steady state is timed inside one run: start-up, data opening and the final checkpoint
    stay out, with no second run to subtract."""
    ends: list[float] = []
    finish_step = TrainingLoop._finish_step

    def timed(self, *args, **kwargs):
        result = finish_step(self, *args, **kwargs)
        ends.append(clock())
        return result

    TrainingLoop._finish_step = timed  # type: ignore[method-assign]
    try:
        yield ends
    finally:
        TrainingLoop._finish_step = finish_step  # type: ignore[method-assign]


def steady_seconds(ends: list[float], steps: int) -> float:
    """Seconds of the last `steps` steps (after WARMUP_STEPS, as the bare loop's)."""
    assert len(ends) == WARMUP_STEPS + steps, f"{len(ends)} steps timed, expected {WARMUP_STEPS + steps}"
    return ends[-1] - ends[WARMUP_STEPS - 1]


def trainer_seconds(setup: Setup, root: Path, data_uri: str, steps: int, run: str) -> float:
    """One process: `train()` in this process (world 1, no process group); seconds of `steps` steps."""
    config = config_for(setup, root, data_uri, WARMUP_STEPS + steps, run)
    plan = build_plan(config, micro_batch_size=setup.micro_batch)
    # The trainer's progress goes to the `batchpilot` logger, which shows nothing here (no console).
    # It runs on CUDA when there is a GPU (bf16 autocast with train.precision auto), else on the CPU.
    with step_ends(single_row_clock()) as ends:
        assert train(config=config, plan=plan, stage="all", output_dir=root / run / "out") == 0
    return steady_seconds(ends, steps)


def fsdp_trainer_seconds(setup: Setup, root: Path, data_uri: str, steps: int, run: str) -> float:
    """`batchpilot train` under torchrun (this file's trainer-worker mode): FSDP_WORLD CPU processes,
    `train.parallelism: fsdp`; seconds of `steps` steps on rank 0."""
    config = config_for(
        setup, root, data_uri, WARMUP_STEPS + steps, run, world_size=FSDP_WORLD, parallelism="fsdp"
    )
    document = make_run_document(config, shape=model_shape(factory=setup.factory, args=setup.model))
    assert document.plan.parallelism == "fsdp" and document.plan.stages[0].world_size == FSDP_WORLD
    plan_path = root / run / "plan.json"
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_text(document.to_json())
    result = root / f"{run}.json"
    train_args = [
        "train",
        "--plan",
        str(plan_path),
        "--stage",
        "all",
        "--output-dir",
        str(root / run / "out"),
    ]
    _torchrun([__file__, "--trainer-worker", str(result), "--steps", str(steps), "--", *train_args])
    return float(json.loads(result.read_text())["seconds"])


def trainer_worker(result: Path, steps: int, train_args: list[str]) -> None:
    """One rank of `batchpilot train` (run under torchrun) with its step ends recorded; rank 0 writes the
    seconds of the last `steps` steps to `result`."""
    with step_ends() as ends:
        assert cli_main(train_args) == 0
    if os.environ.get("RANK") == "0":
        result.write_text(json.dumps({"seconds": steady_seconds(ends, steps)}))


def _torchrun(command: list[str]) -> None:
    """Runs `python <command>` as FSDP_WORLD local ranks (gloo on the CPU), one CPU thread per rank."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={FSDP_WORLD}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([*launcher, *command], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")


# --- the bare loops ---------------------------------------------------------------------------------


def bare_steps(
    model: nn.Module,
    data: torch.Tensor,
    *,
    setup: Setup,
    accumulation: int,
    steps: int,
    sync: Callable[[], None],
    autocast: Callable[[], contextlib.AbstractContextManager],
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds of `steps` optimizer steps after WARMUP_STEPS untimed ones (as the trainer's are timed); `data` holds `[(WARMUP_STEPS + steps) x accumulation, micro, seq_len + 1]` token ids."""
    optimizer = make_optimizer(model, weight_decay=WEIGHT_DECAY)
    for group in optimizer.param_groups:
        group["lr"] = LR
    started = clock()
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            sync()
            started = clock()
        for micro in range(accumulation):
            batch = data[step * accumulation + micro]
            with autocast():
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return clock() - started


def _token_ids(setup: Setup, steps: int, accumulation: int, device: torch.device) -> torch.Tensor:
    shape = ((WARMUP_STEPS + steps) * accumulation, setup.micro_batch, setup.seq_len + 1)
    return torch.randint(0, setup.model["vocab_size"], shape, device=device)


def bare_loop_seconds(setup: Setup, steps: int) -> float:
    """One process, on the device the trainer uses, with its precision (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(factory=setup.factory, args=setup.model).to(device)
    if setup.compile:
        compile_model(model)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    data = _token_ids(setup, steps, setup.accumulation(1), device)
    return bare_steps(
        model,
        data,
        setup=setup,
        accumulation=setup.accumulation(1),
        steps=steps,
        sync=sync,
        autocast=autocast_factory(device, "auto"),
        clock=single_row_clock(),
    )


def fsdp_bare_worker(setup: Setup, steps: int, result: Path) -> None:
    """One rank of the bare FSDP loop (run under torchrun); rank 0 writes the seconds to `result`."""
    dist.init_process_group(backend="gloo")
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(factory=setup.factory, args=setup.model)
    if setup.compile:
        compile_model(model)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    units = shard_units(model)
    head = model.outer_modules()[1][-1]  # type: ignore[operator]
    for index, unit in enumerate(units):  # the unit with the head stays gathered for the backward
        keep = index == len(units) - 1 or any(module is head for module in unit)
        fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    torch.manual_seed(1 + dist.get_rank())  # each rank its own micro-batches, as the trainer's loader
    data = _token_ids(setup, steps, setup.accumulation(world_size), torch.device("cpu"))
    seconds = bare_steps(
        model,
        data,
        setup=setup,
        accumulation=setup.accumulation(world_size),
        steps=steps,
        sync=dist.barrier,
        autocast=autocast_factory(torch.device("cpu"), "auto"),
    )
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"seconds": seconds}))
    dist.destroy_process_group()


def fsdp_bare_seconds(setup: Setup, root: Path, steps: int, run: str) -> float:
    result = root / f"{run}.json"
    worker = ["--fsdp-bare-worker", str(result), "--setup", json.dumps(asdict(setup))]
    _torchrun([__file__, *worker, "--steps", str(steps)])
    return float(json.loads(result.read_text())["seconds"])


# --- measuring --------------------------------------------------------------------------------------


def measure(setup: Setup, *, steps: int, pairs: int, row: str = "single") -> list[tuple[float, float]]:
    """(trainer, bare loop) seconds per step of `row`, one tuple per pair measured back to back.

    Even pairs run the trainer first, odd pairs the bare
    loop first, so neither side always meets the machine in the same state.
    """
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data_uri = f"file://{root}/data"
        subprocess.run(
            [sys.executable, "-m", "batchpilot", "data", "prepare", "--demo", "--out", data_uri],
            check=True,
            capture_output=True,
        )
        measured = []
        for pair in range(pairs):

            def trainer_s(pair: int = pair) -> float:
                seconds = trainer_seconds if row == "single" else fsdp_trainer_seconds
                return seconds(setup, root, data_uri, steps, f"trainer{pair}") / steps

            def bare_s(pair: int = pair) -> float:
                if row == "single":
                    return bare_loop_seconds(setup, steps) / steps
                return fsdp_bare_seconds(setup, root, steps, f"bare{pair}") / steps

            if pair % 2:
                bare = bare_s()
                trainer = trainer_s()
            else:
                trainer = trainer_s()
                bare = bare_s()
            measured.append((trainer, bare))
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps of each run (after 5 warm-up steps)"
    )
    parser.add_argument(
        "--pairs", type=int, default=5, help="trainer/bare pairs per row, measured back to back"
    )
    # A rank of the bare FSDP loop, under torchrun: where to write its seconds, and the Setup as JSON.
    parser.add_argument("--fsdp-bare-worker", type=Path, help=argparse.SUPPRESS)
    # A rank of the trainer under torchrun: where to write its seconds; `batchpilot` arguments after `--`.
    parser.add_argument("--trainer-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("train_args", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--setup", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_worker is not None:
        trainer_worker(args.trainer_worker, args.steps, args.train_args)
        return
    if args.fsdp_bare_worker is not None:
        fsdp_bare_worker(Setup(**args.setup), args.steps, args.fsdp_bare_worker)
        return
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    if not rows or set(rows) - set(ROWS):
        parser.error(f"--rows: {args.rows!r}; choose from {', '.join(ROWS)}")
    print(
        f"model {MODEL['n_layer']}x{MODEL['n_embd']}, global batch {GLOBAL_BATCH}, micro {MICRO_BATCH}, "
        f"seq_len {SEQ_LEN}; {args.steps} steps, {args.pairs} pairs (trainer and bare loop back to back)"
    )
    print(
        f"{'row':<7}| {'batch':<14}| {'trainer ms/step':>15} | {'bare ms/step':>12} | "
        "ratio bare/trainer throughput: median of pairs [min..max]"
    )
    for row in rows:
        world_size = 1 if row == "single" else FSDP_WORLD
        measured = measure(CPU_SETUP, steps=args.steps, pairs=args.pairs, row=row)
        ratios = sorted(bare / trainer for trainer, bare in measured)
        ratio = statistics.median(ratios)
        trainer_s = statistics.median(trainer for trainer, _ in measured)
        bare_s = statistics.median(bare for _, bare in measured)
        batch = f"{MICRO_BATCH} x {world_size} x {CPU_SETUP.accumulation(world_size)}"
        verdict = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
        pairs = " ".join(f"{r:.3f}" for r in ratios)
        print(
            f"{row:<7}| {batch:<14}| {trainer_s * 1000:15.1f} | {bare_s * 1000:12.1f} | "
            f"{ratio:.3f} [{ratios[0]:.3f}..{ratios[-1]:.3f}] {verdict}  (pairs: {pairs})",
            flush=True,
        )
    print(f"target: median ratio >= {TARGET_RATIO} (the trainer's overhead at most 5%)")


if __name__ == "__main__":
    main()
