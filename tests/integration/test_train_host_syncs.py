"""The trainer waits for the device once per optimizer step (under ddp once more, to agree on running out
of memory before the synchronising backward), and the per-step numbers are those it computed when it
read them after every micro-batch.

A host synchronisation is a call that needs a tensor's value on the host: `.item()`, `.tolist()`,
`float()`, `int()`, `bool()`, `.cpu()`, `.numpy()`. On the CPU nothing waits, so the test counts the calls
the training code (`batchpilot/train/`) makes during the steps (checkpoints and validation left out), in
every rank of real gloo processes; on a GPU each of them would wait for the queued kernels.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import batchpilot
from batchpilot.config import parse_config
from batchpilot.models.gpt import build
from batchpilot.plan.stages import build_plan
from batchpilot.train import trainer
from batchpilot.train.distributed import DistContext
from batchpilot.train.loop import TrainingLoop
from batchpilot.train.parallel import wrap_model
from batchpilot.train.setup import make_optimizer
from batchpilot.train.step import accumulate_gradients

STEPS = 4
TRAINING_CODE = os.path.join(Path(batchpilot.__file__).parent, "train", "")
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def count_host_syncs() -> Counter:
    """Counts host synchronisations made by the training code (`batchpilot/train/`) inside `TrainingLoop._attempt`
    and `_finish_step` (one optimizer step: the passes, clipping, the optimizer, metrics), by `file:line`.
    The loader's token ids are host memory by design (`data/`), not device values."""
    counts: Counter = Counter()
    inside = [False]
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1)
            if inside[0] and caller.f_code.co_filename.startswith(TRAINING_CODE):
                counts[f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counting)
    for method in ("_attempt", "_finish_step"):
        original_method = getattr(TrainingLoop, method)

        def counted(self, *args, _original=original_method, **kwargs):
            inside[0] = True
            try:
                return _original(self, *args, **kwargs)
            finally:
                inside[0] = False

        setattr(TrainingLoop, method, counted)
    return counts


def _worker(
    rank: int, world_size: int, per_node: int, port: int, root: str, data_uri: str, strategy: str
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    config = parse_config(
        {
            "name": "syncs",
            "model": {"args": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}},
            "data": {"uri": data_uri, "seq_len": 32},
            "cluster": {"devices_per_node": per_node, "max_nodes": world_size // per_node},
            "batch": {"global_batch_size": 32, "micro_batch_size": 2},
            "train": {
                "total_samples": 32 * STEPS,
                "lr": 1e-3,
                "checkpoint_uri": f"file://{root}/ckpt",
                "checkpoint_every_s": 0,
                "measure_coherence": True,
                "eval_samples": 0,  # validation is not a training step's work
            },
        }
    )
    plan = replace(build_plan(config, micro_batch_size=2), parallelism=strategy)
    counts = count_host_syncs()
    assert trainer.train(config=config, plan=plan, stage="all", output_dir=Path(root) / "out") == 0
    Path(f"{root}/syncs.rank{rank}.json").write_text(json.dumps(counts))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "world_size", "per_node", "per_step"),
    [("fsdp", 2, 2, 1), ("hsdp", 4, 2, 1), ("ddp", 2, 2, 2)],
)
def test_one_host_synchronisation_per_step(
    demo_data_uri, tmp_path, monkeypatch, strategy, world_size, per_node, per_step
):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    args = (world_size, per_node, free_port(), str(tmp_path), demo_data_uri, strategy)
    mp.spawn(_worker, args=args, nprocs=world_size, join=True)
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert (
        len(metrics) == STEPS and json.loads(metrics[-1])["gradient_accumulation_steps"] == 16 // world_size
    )
    for rank in range(world_size):
        counts = json.loads((tmp_path / f"syncs.rank{rank}.json").read_text())
        assert sum(counts.values()) == per_step * STEPS, (rank, counts)


# The accumulated loss, small-batch squared norm and coherence of 3 optimizer steps of one process
# (micro batch 4, accumulation 4), as the trainer computed them when it called .item() and float() after
# every micro-batch (batchpilot at 43e2221); gradient norm after the step.
BEFORE = [
    (4.173812747001648, 1.79051179689702, 0.0963971151052541, 0.723712146282196),
    (4.167654037475586, 1.6606698866328349, 0.04269305556457477, 0.6437953114509583),
    (4.165099501609802, 1.7553639180578247, 0.023580034724996098, 0.7018939256668091),
]


def test_step_numbers_are_unchanged_by_reading_them_once():
    torch.manual_seed(0)
    model = build(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    parallel = wrap_model(model, ctx, strategy="ddp", bf16=False, materialize=lambda _: None)
    optimizer = make_optimizer(model, weight_decay=0.1)
    for group in optimizer.param_groups:
        group["lr"] = 1e-3
    generator = torch.Generator().manual_seed(3)
    measured = []
    for _ in BEFORE:
        outcome = accumulate_gradients(
            model=model,
            parallel=parallel,
            micro_batches=[torch.randint(0, 64, (4, 17), generator=generator) for _ in range(4)],
            ctx=ctx,
            autocast=contextlib.nullcontext,
            measure_noise=True,
            measure_coherence=True,
        )
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured.append(
            (float(outcome.loss), float(outcome.small_sq_norm), float(outcome.coherence), float(norm))
        )
    for step, (before, now) in enumerate(zip(BEFORE, measured, strict=True)):
        assert now == pytest.approx(before, rel=1e-6), step
