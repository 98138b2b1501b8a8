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
from pathlib import Path

import torch
from torch.nn import functional as F

from batchpilot.config import parse_config
from batchpilot.models.factory import build_model
from batchpilot.planner import build_plan
from batchpilot.train.trainer import make_optimizer, train

MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257}
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 32, 8, 128


def config_for(root: Path, data_uri: str, steps: int, run: str):
    return parse_config(
        {
            "name": "bench",
            "model": {"args": MODEL},
            "data": {"uri": data_uri, "seq_len": SEQ_LEN},
            "cluster": {"devices_per_node": 1, "max_nodes": 1},
            "batch": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH},
            "train": {
                "total_samples": steps * GLOBAL_BATCH,
                "lr": 3e-4,
                "checkpoint_uri": f"file://{root}/{run}/ckpt",
            },
        }
    )


def trainer_seconds(root: Path, data_uri: str, steps: int, run: str) -> float:
    config = config_for(root, data_uri, steps, run)
    plan = build_plan(config, micro_batch_size=MICRO_BATCH)
    started = time.perf_counter()
    # The trainer's progress goes to the `batchpilot` logger, which shows nothing here (no console).
    assert train(config=config, plan=plan, stage="all", output_dir=root / run / "out") == 0
    return time.perf_counter() - started


def bare_loop_seconds(steps: int, *, warmup_steps: int = 5) -> float:
    """Time of `steps` steps after `warmup_steps` untimed ones (the trainer's short run plays that role)."""
    torch.manual_seed(0)
    model = build_model(factory="batchpilot.models.gpt:build", args=MODEL)
    optimizer = make_optimizer(model, weight_decay=0.1)
    accumulation = GLOBAL_BATCH // MICRO_BATCH
    total = warmup_steps + steps
    data = torch.randint(0, 257, (total * accumulation, MICRO_BATCH, SEQ_LEN + 1))
    started = time.perf_counter()
    for step in range(total):
        if step == warmup_steps:
            started = time.perf_counter()
        for micro in range(accumulation):
            batch = data[step * accumulation + micro]
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="extra steps of the longer trainer run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data_uri = f"file://{root}/data"
        subprocess.run(
            [sys.executable, "-m", "batchpilot", "data", "prepare", "--demo", "--out", data_uri],
            check=True,
            capture_output=True,
        )
        short, long = 5, 5 + args.steps
        trainer, bare = [], []
        for repeat in range(args.repeats):
            t_short = trainer_seconds(root, data_uri, short, f"short{repeat}")
            t_long = trainer_seconds(root, data_uri, long, f"long{repeat}")
            trainer.append((t_long - t_short) / args.steps)
            bare.append(bare_loop_seconds(args.steps) / args.steps)
    trainer_s, bare_s = statistics.median(trainer), statistics.median(bare)
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
