"""Cross-node gradient traffic of hsdp per optimizer step, against one full gradient all-reduce.

Four gloo processes on the CPU stand for 2 nodes x 2 devices (`LOCAL_WORLD_SIZE=2`): hsdp shards within a
node and replicates across. Each rank runs the trainer's passes (`accumulate_gradients`, accumulation 4)
on the bench model and counts, in-process, the bytes of every collective whose group spans both nodes.
Rows:
- `hsdp`: the trainer as it is (the node reduce-scatters every pass, all-reduces across nodes on the last);
- `hsdp, all-reduce every pass`: the same with the cross-node all-reduce switched on for every pass (what
  the trainer did before), for comparison.

The ratio is cross-node bytes per optimizer step over the bytes of one all-reduce of this rank's gradient
shard (what one cross-node reduction of the whole gradient moves): target <= 1.05.

Run: .venv/bin/python bench/hsdp_comm.py [--steps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpilot.models.factory import build_model
from batchpilot.train import step as step_module
from batchpilot.train.distributed import DistContext
from batchpilot.train.parallel import set_cross_node_reduction, wrap_model
from batchpilot.train.step import accumulate_gradients

FACTORY = "batchpilot.models.gpt:build"
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257}
NODES, PER_NODE, MICRO, ACCUMULATION, SEQ_LEN = 2, 2, 2, 4, 128
TARGET_RATIO = 1.05
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


def count_cross_node(counts: Counter) -> None:
    """Wraps torch.distributed's collectives (as FSDP2 calls them) to add the bytes of those whose group
    spans nodes to `counts[name]`."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group")
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            if len({rank // PER_NODE for rank in ranks}) > 1:
                tensor = kwargs.get("tensor", kwargs.get("output", args[0] if args else None))
                counts[_name] += tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)

        setattr(dist, name, counting)


def worker(rank: int, port: int, steps: int, every_pass: bool, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(NODES * PER_NODE), LOCAL_RANK=str(rank % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    ctx = DistContext.from_env()
    torch.manual_seed(0)
    model = build_model(factory=FACTORY, args=MODEL)
    parallel = wrap_model(model, ctx, strategy="hsdp", bf16=False)
    if every_pass:  # the trainer before: every pass all-reduces across nodes
        step_module.set_cross_node_reduction = lambda parallel, enabled: set_cross_node_reduction(  # type: ignore[assignment]
            parallel, enabled=True
        )
    counts: Counter = Counter()
    count_cross_node(counts)
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        batches = [
            torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ_LEN + 1), generator=generator)
            for _ in range(ACCUMULATION)
        ]
        outcome = accumulate_gradients(
            model=model,
            parallel=parallel,
            micro_batches=batches,
            ctx=ctx,
            autocast=contextlib.nullcontext,
            measure_noise=not every_pass,  # the noise terms read the node's partial sums between passes
            measure_coherence=False,
        )
        assert outcome.completed and outcome.loss is not None
        # The trainer's one agreement per step (loss, noise term, stop and checkpoint flags: 32 bytes).
        zero = torch.zeros((), dtype=torch.float64)
        small_sq = outcome.small_sq_norm if outcome.small_sq_norm is not None else zero
        ctx.step_values(means=[outcome.loss, small_sq], flags=[False, False], local=[zero])
        model.zero_grad(set_to_none=True)
    gradient_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": dict(counts), "gradient_bytes": gradient_bytes}))
    dist.destroy_process_group()


def measure(*, steps: int, every_pass: bool) -> tuple[dict[str, float], int]:
    """(cross-node bytes per step by collective, one gradient shard's bytes) on rank 0."""
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        out = f"{tmp}/result.json"
        mp.spawn(worker, args=(port, steps, every_pass, out), nprocs=NODES * PER_NODE, join=True)
        result = json.loads(Path(out).read_text())
    per_step = {name: result["bytes"].get(name, 0) / steps for name in COLLECTIVES}
    return per_step, result["gradient_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(
        f"model {MODEL['n_layer']}x{MODEL['n_embd']} (GPT, fp32), {NODES} nodes x {PER_NODE} ranks (gloo, CPU), "
        f"micro {MICRO}, accumulation {ACCUMULATION}; {args.steps} steps, bytes on rank 0"
    )
    print(f"{'row':<28}| {'all-reduce B/step':>17} | {'other B/step':>12} | {'one gradient B':>14} | ratio")
    for label, every_pass in (("hsdp", False), ("hsdp, all-reduce every pass", True)):
        per_step, gradient_bytes = measure(steps=args.steps, every_pass=every_pass)
        other = per_step["reduce_scatter_tensor"] + per_step["all_gather_into_tensor"]
        ratio = (per_step["all_reduce"] + other) / gradient_bytes
        verdict = ("ok" if ratio <= TARGET_RATIO else "ABOVE TARGET") if not every_pass else "(before)"
        print(
            f"{label:<28}| {per_step['all_reduce']:17,.0f} | {other:12,.0f} | {gradient_bytes:14,} | {ratio:.3f} {verdict}",
            flush=True,
        )
    print(
        f"target: hsdp ratio <= {TARGET_RATIO} (one cross-node reduction of the gradient per optimizer step)"
    )


if __name__ == "__main__":
    main()
