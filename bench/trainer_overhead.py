"""Trainer throughput against a bare PyTorch loop: same model, batch, accumulation, in the same run.

Rows (`--rows`):
- `single`: one process, no process group; the trainer runs in this process (`train()`), the bare loop
  too, on CUDA when there is a GPU (bf16 autocast), else on the CPU with the process's default threads.
- `fsdp`: two CPU processes with gloo under torchrun, one thread each (OMP_NUM_THREADS=1 on both sides):
  the trainer as `batchpilot train` with `train.parallelism: fsdp`, the bare loop as this file's worker
  mode, which applies `fully_shard` to each block then the root on a 1-D mesh, as the trainer does.

The trainer's steady-state time per step is the difference between two runs of different length (so
start-up, data opening and the final checkpoint cancel out); the bare loop times `steps` steps after
warm-up ones, with the same model, AdamW, micro-batches per rank, accumulation, clipping and loss, and
micro-batches from memory. Each row prints the throughput ratio bare/trainer (target >= 0.95, i.e. the
trainer's overhead is at most 5%).

Run: .venv/bin/python bench/trainer_overhead.py [--rows single,fsdp] [--steps 20] [--repeats 3]
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

from batchpilot.config import Config, parse_config
from batchpilot.models.factory import build_model
from batchpilot.planner import build_plan, make_run_document
from batchpilot.train.shape import model_shape
from batchpilot.train.trainer import autocast_factory, make_optimizer, train

FACTORY = "batchpilot.models.gpt:build"
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257}
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 32, 8, 128
LR, WEIGHT_DECAY, GRAD_CLIP = 3e-4, 0.1, 1.0
SHORT_STEPS = WARMUP_STEPS = 5
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
            "model": {"factory": FACTORY, "args": setup.model},
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
            },
        }
    )


# --- the trainer ------------------------------------------------------------------------------------


def trainer_seconds(setup: Setup, root: Path, data_uri: str, steps: int, run: str) -> float:
    """One process: `train()` in this process (world 1, no process group)."""
    config = config_for(setup, root, data_uri, steps, run)
    plan = build_plan(config, micro_batch_size=setup.micro_batch)
    started = time.perf_counter()
    # The trainer's progress goes to the `batchpilot` logger, which shows nothing here (no console).
    # It runs on CUDA when there is a GPU (bf16 autocast with train.precision auto), else on the CPU.
    assert train(config=config, plan=plan, stage="all", output_dir=root / run / "out") == 0
    return time.perf_counter() - started


def fsdp_trainer_seconds(setup: Setup, root: Path, data_uri: str, steps: int, run: str) -> float:
    """`batchpilot train` under torchrun: FSDP_WORLD CPU processes, `train.parallelism: fsdp`."""
    config = config_for(setup, root, data_uri, steps, run, world_size=FSDP_WORLD, parallelism="fsdp")
    document = make_run_document(config, shape=model_shape(factory=FACTORY, args=setup.model))
    assert document.plan.parallelism == "fsdp" and document.plan.stages[0].world_size == FSDP_WORLD
    plan_path = root / run / "plan.json"
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_text(document.to_json())
    command = ["-m", "batchpilot", "train", "--plan", str(plan_path), "--stage", "all"]
    started = time.perf_counter()
    _torchrun([*command, "--output-dir", str(root / run / "out")])
    return time.perf_counter() - started


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
) -> float:
    """Seconds of `steps` optimizer steps after WARMUP_STEPS untimed ones (the trainer's short run plays
    that role); `data` holds `[(WARMUP_STEPS + steps) x accumulation, micro, seq_len + 1]` token ids."""
    optimizer = make_optimizer(model, weight_decay=WEIGHT_DECAY)
    for group in optimizer.param_groups:
        group["lr"] = LR
    started = time.perf_counter()
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            sync()
            started = time.perf_counter()
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
    return time.perf_counter() - started


def _token_ids(setup: Setup, steps: int, accumulation: int, device: torch.device) -> torch.Tensor:
    shape = ((WARMUP_STEPS + steps) * accumulation, setup.micro_batch, setup.seq_len + 1)
    return torch.randint(0, setup.model["vocab_size"], shape, device=device)


def bare_loop_seconds(setup: Setup, steps: int) -> float:
    """One process, on the device the trainer uses, with its precision (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(factory=FACTORY, args=setup.model).to(device)
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
    )


def fsdp_bare_worker(setup: Setup, steps: int, result: Path) -> None:
    """One rank of the bare FSDP loop (run under torchrun); rank 0 writes the seconds to `result`."""
    dist.init_process_group(backend="gloo")
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(factory=FACTORY, args=setup.model)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy())
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


def measure(setup: Setup, *, steps: int, repeats: int, row: str = "single") -> tuple[float, float]:
    """(trainer, bare loop) seconds per step of `row`, each the median of `repeats`, measured in this run.

    The trainer's steady-state step time is the difference between a short and a long run, so start-up,
    data opening and the final checkpoint cancel out.
    """
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data_uri = f"file://{root}/data"
        subprocess.run(
            [sys.executable, "-m", "batchpilot", "data", "prepare", "--demo", "--out", data_uri],
            check=True,
            capture_output=True,
        )
        trainer, bare = [], []
        for repeat in range(repeats):
            if row == "single":
                t_short = trainer_seconds(setup, root, data_uri, SHORT_STEPS, f"short{repeat}")
                t_long = trainer_seconds(setup, root, data_uri, SHORT_STEPS + steps, f"long{repeat}")
                t_bare = bare_loop_seconds(setup, steps)
            else:
                t_short = fsdp_trainer_seconds(setup, root, data_uri, SHORT_STEPS, f"short{repeat}")
                t_long = fsdp_trainer_seconds(setup, root, data_uri, SHORT_STEPS + steps, f"long{repeat}")
                t_bare = fsdp_bare_seconds(setup, root, steps, f"bare{repeat}")
            trainer.append((t_long - t_short) / steps)
            bare.append(t_bare / steps)
    return statistics.median(trainer), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=20, help="extra steps of the longer trainer run")
    parser.add_argument("--repeats", type=int, default=3)
    # A rank of the bare FSDP loop, under torchrun: where to write its seconds, and the Setup as JSON.
    parser.add_argument("--fsdp-bare-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--setup", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fsdp_bare_worker is not None:
        fsdp_bare_worker(Setup(**args.setup), args.steps, args.fsdp_bare_worker)
        return
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    if not rows or set(rows) - set(ROWS):
        parser.error(f"--rows: {args.rows!r}; choose from {', '.join(ROWS)}")
    print(
        f"model {MODEL['n_layer']}x{MODEL['n_embd']}, global batch {GLOBAL_BATCH}, micro {MICRO_BATCH}, "
        f"seq_len {SEQ_LEN}; {args.steps} steps, median of {args.repeats}"
    )
    print(
        f"{'row':<7}| {'batch':<14}| {'trainer ms/step':>15} | {'bare ms/step':>12} | ratio (bare/trainer throughput)"
    )
    for row in rows:
        world_size = 1 if row == "single" else FSDP_WORLD
        trainer_s, bare_s = measure(CPU_SETUP, steps=args.steps, repeats=args.repeats, row=row)
        ratio = bare_s / trainer_s
        batch = f"{MICRO_BATCH} x {world_size} x {CPU_SETUP.accumulation(world_size)}"
        verdict = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
        print(
            f"{row:<7}| {batch:<14}| {trainer_s * 1000:15.1f} | {bare_s * 1000:12.1f} | {ratio:.3f} {verdict}",
            flush=True,
        )
    print(f"target: ratio >= {TARGET_RATIO} (the trainer's overhead at most 5%)")


if __name__ == "__main__":
    main()
