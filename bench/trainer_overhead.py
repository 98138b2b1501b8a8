"""Trainer throughput against a bare PyTorch loop: same model, batch, accumulation, in the same run.

The trainer's steady-state time per step is measured as the difference between two runs of different
length (so start-up, data opening and the final checkpoint cancel out); the bare loop trains the same
model with the same optimizer and micro-batches from memory. Prints the overhead ratio (target < 5%).

Run: .venv/bin/python bench/trainer_overhead.py [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from batchpilot.config import parse_config
from batchpilot.models.factory import build_model
from batchpilot.planner import build_plan
from batchpilot.train.trainer import autocast_factory, make_optimizer, train

MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257}
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 32, 8, 128


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


CPU_SETUP = Setup(MODEL, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN)


def config_for(setup: Setup, root: Path, data_uri: str, steps: int, run: str):
    return parse_config(
        {
            "name": "bench",
            "model": {"args": setup.model},
            "data": {"uri": data_uri, "seq_len": setup.seq_len},
            "cluster": {"devices_per_node": 1, "max_nodes": 1},
            "batch": {"global_batch_size": setup.global_batch, "micro_batch_size": setup.micro_batch},
            "train": {
                "total_samples": steps * setup.global_batch,
                "lr": 3e-4,
                "checkpoint_uri": f"file://{root}/{run}/ckpt",
                "checkpoint_every_s": 0,
            },
        }
    )


def trainer_seconds(setup: Setup, root: Path, data_uri: str, steps: int, run: str) -> float:
    config = config_for(setup, root, data_uri, steps, run)
    plan = build_plan(config, micro_batch_size=setup.micro_batch)
    started = time.perf_counter()
    # The trainer's progress goes to the `batchpilot` logger, which shows nothing here (no console).
    # It runs on CUDA when there is a GPU (bf16 autocast with train.precision auto), else on the CPU.
    assert train(config=config, plan=plan, stage="all", output_dir=root / run / "out") == 0
    return time.perf_counter() - started


def bare_loop_seconds(setup: Setup, steps: int, *, warmup_steps: int = 5) -> float:
    """Time of `steps` steps after `warmup_steps` untimed ones (the trainer's short run plays that role),
    on the device the trainer uses, with the trainer's precision (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = autocast_factory(device, "auto")
    model = build_model(factory="batchpilot.models.gpt:build", args=setup.model).to(device)
    optimizer = make_optimizer(model, weight_decay=0.1)
    accumulation = setup.global_batch // setup.micro_batch
    total = warmup_steps + steps
    data = torch.randint(0, 257, (total * accumulation, setup.micro_batch, setup.seq_len + 1), device=device)
    started = time.perf_counter()
    for step in range(total):
        if step == warmup_steps:
            _synchronize(device)
            started = time.perf_counter()
        for micro in range(accumulation):
            batch = data[step * accumulation + micro]
            with autocast():
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(setup: Setup, *, steps: int, repeats: int) -> tuple[float, float]:
    """(trainer, bare loop) seconds per step, each the median of `repeats`, measured in this run.

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
        short, long = 5, 5 + steps
        trainer, bare = [], []
        for repeat in range(repeats):
            t_short = trainer_seconds(setup, root, data_uri, short, f"short{repeat}")
            t_long = trainer_seconds(setup, root, data_uri, long, f"long{repeat}")
            trainer.append((t_long - t_short) / steps)
            bare.append(bare_loop_seconds(setup, steps) / steps)
    return statistics.median(trainer), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="extra steps of the longer trainer run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trainer_s, bare_s = measure(CPU_SETUP, steps=args.steps, repeats=args.repeats)
    overhead = trainer_s / bare_s - 1
    print(
        f"model {MODEL['n_layer']}x{MODEL['n_embd']}, global batch {GLOBAL_BATCH} = micro {MICRO_BATCH} x 1 x "
        f"accumulation {GLOBAL_BATCH // MICRO_BATCH}, seq_len {SEQ_LEN}, CPU, median of {args.repeats}"
    )
    print(
        f"bare PyTorch loop: {bare_s * 1000:8.1f} ms/step  ({GLOBAL_BATCH * SEQ_LEN / bare_s:,.0f} tokens/s)"
    )
    print(
        f"batchpilot trainer: {trainer_s * 1000:7.1f} ms/step  ({GLOBAL_BATCH * SEQ_LEN / trainer_s:,.0f} tokens/s)"
    )
    verdict = "ok" if overhead < 0.05 else "ABOVE TARGET"
    print(
        f"trainer / bare loop time ratio: {trainer_s / bare_s:.3f} (overhead {overhead:+.1%}; target < 5%: {verdict})"
    )


if __name__ == "__main__":
    main()
