"""`train.init_from` in the trainer: stage 0 on 2 gloo ranks, under DDP from a local folder and under FSDP from
a gs:// folder (a real GCS server; downloaded once by local rank 0), starts from a sharded Hugging Face Llama
checkpoint (its first step's loss is the loss transformers computes on that batch), and the next stage
resumes from the run's own checkpoint without reading the Hugging Face folder again (it is gone by then)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import functional as F

from batchpilot.data.loader import TokenLoader
from batchpilot.runstate import read_metrics
from helpers import run_batchpilot
from hf_files import LLAMA_ARGS, write_hf_llama

SEQ_LEN = 32


def write_checkpoint(folder: Path) -> Path:
    """A sharded LlamaForCausalLM saved by transformers (with model.safetensors.index.json), with weights far
    from an untrained model's (std 0.3), so that its loss tells it apart from a freshly initialised one."""
    return write_hf_llama(folder, max_shard_size="100KB", std=0.3)


def write_run(root: Path, *, data_uri: str, init_from: str, parallelism: str) -> Path:
    """config.yaml and, through `batchpilot plan`, plan.json in `root` for 2 processes of 1 node: stage 0 at
    batch 8 (4 steps), the final stage at 16 (2 steps); returns the plan's path."""
    args = LLAMA_ARGS
    config = {
        "name": "init-from",
        "model": {"factory": "batchpilot.models.llama:build", "args": args},
        "data": {"uri": data_uri, "seq_len": SEQ_LEN},
        "cluster": {"devices_per_node": 2, "max_nodes": 1},
        "batch": {"global_batch_size": 16, "micro_batch_size": 4, "schedule": "0:8 32:16"},
        "train": {
            "total_samples": 64, "lr": 1.0e-3, "checkpoint_uri": f"file://{root}/ckpt", "parallelism": parallelism,
            "eval_samples": 0, "init_from": init_from,
        },
        "explore": {"study": False},
    }  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    planned = run_batchpilot("plan", "--config", str(root / "config.yaml"), "--out", str(root / "plan.json"))
    assert planned.returncode == 0, planned.stderr
    return root / "plan.json"


def torchrun_train(plan: Path, stage: str, out: Path) -> subprocess.CompletedProcess[str]:
    """`batchpilot train` of one stage as 2 ranks of a torchrun job on this machine (gloo)."""
    return subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "batchpilot", "train", "--plan", str(plan), "--stage", stage, "--out", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def first_batch_loss(folder: Path, *, data_uri: str, global_batch_size: int) -> float:
    """transformers' mean next-token loss of the checkpoint on the run's first global batch."""
    from transformers import LlamaForCausalLM

    loader = TokenLoader(uri=data_uri, seq_len=SEQ_LEN, seed=0)  # the trainer's order, as one rank reads it
    try:
        (batch,) = loader.micro_batches(
            consumed_samples=0,
            global_batch_size=global_batch_size,
            micro_batch_size=global_batch_size,
            gradient_accumulation_steps=1,
        )
    finally:
        loader.close()
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def first_losses(run: Path, done: subprocess.CompletedProcess[str]) -> list[float]:
    """The losses of stage 0's steps, which `done` trained into `run`/out."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(21 tensors of a Hugging Face Llama checkpoint)" in done.stdout
    records = read_metrics(run / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[0]["world_size"] == 2
    return [r["loss"] for r in records]


@pytest.mark.slow
def test_stage_0_starts_from_the_checkpoint_and_a_resume_does_not_reload_it(
    tmp_path, demo_data_uri, gcs_client, gcs_bucket, monkeypatch
):
    hf = write_checkpoint(tmp_path / "hf")
    assert len(list(hf.glob("model-*-of-*.safetensors"))) > 2
    expected = first_batch_loss(hf, data_uri=demo_data_uri, global_batch_size=8)
    assert abs(expected - math.log(300)) > 0.5  # far from an untrained model's loss: the check can fail
    for path in hf.iterdir():
        gcs_client.bucket(gcs_bucket).blob(f"llama/{path.name}").upload_from_filename(str(path))
    monkeypatch.setenv("BATCHPILOT_INIT_FROM_CACHE", str(tmp_path / "node-cache"))  # the ranks inherit it
    sources = {"ddp": str(hf), "fsdp": f"gs://{gcs_bucket}/llama"}
    for parallelism, source in sources.items():
        run = tmp_path / parallelism
        plan = write_run(run, data_uri=demo_data_uri, init_from=source, parallelism=parallelism)
        done = torchrun_train(plan, "0", run / "out")
        assert first_losses(run, done)[0] == pytest.approx(expected, abs=1e-4), parallelism
    # Under fsdp (gs://) each rank read its own shards' byte ranges from the bucket: no copy on the node.
    for rank in (0, 1):
        assert f"[rank {rank}] train.init_from {source}: read " in done.stdout, done.stdout[-3000:]
    assert "downloaded" not in done.stdout and not (tmp_path / "node-cache").exists()

    # The fsdp run (the loop's last) resumes its final stage with the folder gone from the bucket and the node.
    for blob in gcs_client.list_blobs(gcs_bucket):
        blob.delete()
    second = torchrun_train(plan, "final", run / "out")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"train.init_from {source} not loaded: resuming from step 4's checkpoint" in second.stdout
    assert [r["step"] for r in read_metrics(run / "out" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
