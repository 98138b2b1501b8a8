"""Training time blocked per checkpoint: the asynchronous save against the synchronous one, in one run.

One process on the CPU, a GPT of about 67M parameters (268 MB of fp32 weights; with AdamW's two moments
the checkpoint is about 800 MB), checkpoints to a local folder (`file://`). Both modes run the same loop:
`--steps-between` optimizer steps, then a save, `--saves` times.

- synchronous: `Checkpointer.save_sharded` (every file written, hashed, committed before it returns).
- asynchronous: `Checkpointer.start_save_sharded` (waits for the previous save if it is still running, copies
  the state to CPU memory, returns; the files are written in a background thread). The final checkpoint's
  wait is reported on its own line (a stage waits for it once, before the process exits).

Prints the blocked seconds per save of each mode, their ratio (target <= 0.2, bench/README.md), the
median step time while a save was being written against the other steps of the same run (target <= 1.10),
the same for saves 2..n only (spread over half the time since the previous one; the first is not), and
the writer process's CPU seconds per save (the CPU a save takes from the steps where every core trains).

    .venv/bin/python bench/checkpoint_blocking.py [--saves 3] [--steps-between 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from batchpilot.models.gpt import build
from batchpilot.storage import open_storage
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
from batchpilot.train.setup import make_optimizer
from batchpilot.train.state import training_state

MODEL_ARGS = {"n_layer": 6, "n_head": 12, "n_embd": 768, "block_size": 64, "vocab_size": 32000}
BATCH, SEQ = 1, 64


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    started = time.perf_counter()
    tokens = torch.randint(0, MODEL_ARGS["vocab_size"], (BATCH, SEQ + 1))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def process_cpu_s(pid: int | None) -> float:
    """User and system CPU seconds of a running process (/proc/PID/stat)."""
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(*, mode: str, root: Path, saves: int, steps_between: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = build(**MODEL_ARGS)
    optimizer = make_optimizer(model, weight_decay=0.1)
    train_step(model, optimizer)  # AdamW's moments exist from here on: a checkpoint of full size
    uri = f"file://{root / mode}"
    # "thread": the files written by the background thread in this process (a storage object given to the
    # Checkpointer is written in-process), as before the writer process; "async": by the writer process
    storage = open_storage(uri) if mode == "thread" else None
    checkpointer = Checkpointer(uri=uri, keep_last=2, storage=storage)
    if mode == "async":  # as the trainer does at a launch's start-up when it saves before its end
        checkpointer.start_writer()
        assert checkpointer._writer is not None and checkpointer._writer.pid is not None  # waits: start-up's
    blocked, step_times, writing, steady, writing_later = [], [], [], [], []
    writer_cpu_from = float("nan")
    step = 1
    for save in range(saves):
        for _ in range(steps_between):
            during = checkpointer.writing
            seconds = train_step(model, optimizer)
            step_times.append(seconds)
            # a step that ran wholly while a save was being written, or wholly without one
            (writing if during and checkpointer.writing else steady if not during else []).append(seconds)
            if (
                during and checkpointer.writing and save >= 2
            ):  # the first save is not spread (no interval yet)
                writing_later.append(seconds)
            step += 1
        state = training_state(model, optimizer)
        started = time.perf_counter()
        if mode == "sync":
            checkpointer.save_sharded(step=step, consumed_samples=step, state=state, rng=capture_rng_state())
        else:
            checkpointer.start_save_sharded(
                step=step, consumed_samples=step, state=state, rng=capture_rng_state()
            )
        blocked.append(time.perf_counter() - started)
        if save == 1 and mode == "async":  # the first save's write has ended (a save waits for the last one)
            writer_cpu_from = process_cpu_s(checkpointer._writer.pid)  # type: ignore[union-attr]
    started = time.perf_counter()
    checkpointer.wait()
    final_wait_s = time.perf_counter() - started
    writer_cpu_s = (
        (process_cpu_s(checkpointer._writer.pid) - writer_cpu_from) / (saves - 1)  # type: ignore[union-attr]
        if mode == "async" and saves > 1
        else float("nan")
    )
    checkpointer.close()
    size_bytes = sum(p.stat().st_size for p in (root / mode / f"{step:09d}").iterdir())
    return {
        "blocked_s": statistics.mean(blocked),
        "first_blocked_s": blocked[0],
        "final_wait_s": final_wait_s,
        # the first save's steps run before any save was in flight in either mode
        "step_s": statistics.mean(step_times[steps_between:]),
        "writing_step_s": statistics.median(writing) if writing else float("nan"),
        "steady_step_s": statistics.median(steady) if steady else float("nan"),
        "writing_steps": len(writing),
        "writing_later_step_s": statistics.median(writing_later) if writing_later else float("nan"),
        "writing_later_steps": len(writing_later),
        "checkpoint_bytes": size_bytes,
        "writer_cpu_s": writer_cpu_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for training (0: torch's default, every core)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    num_params = sum(p.numel() for p in build(**MODEL_ARGS).parameters())
    print(
        f"GPT {num_params / 1e6:.1f}M parameters ({num_params * 4 / 1e6:.0f} MB fp32), torch {torch.__version__}, "
        f"{platform.machine()} with {torch.get_num_threads()} threads; {args.saves} saves, "
        f"{args.steps_between} steps between saves"
    )
    with tempfile.TemporaryDirectory(prefix="checkpoint-bench-") as folder:
        results = {
            mode: run(mode=mode, root=Path(folder), saves=args.saves, steps_between=args.steps_between)
            for mode in ("sync", "thread", "async")
        }
    sync, thread, asynchronous = results["sync"], results["thread"], results["async"]
    print(f"checkpoint size: {sync['checkpoint_bytes'] / 1e6:.0f} MB (file://, one process)")
    print("| mode | blocked per save s | first save s | final wait s | step s (saves 2..n) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, row in results.items():
        print(
            f"| {mode} | {row['blocked_s']:.3f} | {row['first_blocked_s']:.3f} | {row['final_wait_s']:.3f} "
            f"| {row['step_s']:.3f} |"
        )
    print(
        f"ratio (async blocked / sync blocked): {asynchronous['blocked_s'] / sync['blocked_s']:.3f}  (target <= 0.2)"
    )
    print(f"step time with a save in the background / without: {asynchronous['step_s'] / sync['step_s']:.3f}")
    print(
        f"async: the writer process's CPU per save (saves 2..n, user + system): {asynchronous['writer_cpu_s']:.2f} s"
    )
    for name, row in (("thread", thread), ("async", asynchronous)):
        print(
            f"{name}: step time while a save is being written / steady step time (medians of "
            f"{row['writing_steps']} steps and of the others in the same run): "
            f"{row['writing_step_s'] / row['steady_step_s']:.3f}"
            + ("  (target <= 1.10)" if name == "async" else "  (the writer thread, before the process)")
        )
    print(
        "async, saves 2..n (spread over half the time since the previous save; the first is written at full "
        "speed): step time while a save is being written / steady step time (medians of "
        f"{asynchronous['writing_later_steps']} steps and of the steady ones): "
        f"{asynchronous['writing_later_step_s'] / asynchronous['steady_step_s']:.3f}"
    )


if __name__ == "__main__":
    main()
