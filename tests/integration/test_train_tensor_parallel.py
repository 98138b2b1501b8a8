"""Tensor parallelism in the trainer: 2 local nodes x 2 processes (gloo), each node one tensor-parallel group
of 2 (`train.tensor_parallel_size: 2`), fsdp over the 2 groups; a Llama (the model with a plan).

- It trains as dp=4 does on the same 4 processes: the same initial weights (the meta build replays the seed's
  initialisation onto each rank's part), the same samples per data-parallel rank, the same losses.
- A ramp from 1 node (data-parallel size 1) to 2 nodes (2) resumes from the DCP checkpoint resharded onto the
  new mesh, and every sample is trained once.
- kill -9 of any rank, then a resume, ends with the model and AdamW state bit for bit those of the
  uninterrupted run; an out-of-memory error inside the split passes ends the job, whose retry trains with
  half the micro batch;
- its DCP checkpoint exports as a Hugging Face Llama.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from batchpilot.data.sampling import num_samples, sample_at
from batchpilot.runstate import read_metrics
from batchpilot.train.checkpoint import Checkpointer
from helpers import (
    assert_same_run,
    kill_9_then_resume,
    run_batchpilot,
    tiny_config,
    write_plan,
)

pytestmark = pytest.mark.slow

STEPS = 16
LLAMA = {
    "factory": "batchpilot.models.llama:build",
    "args": {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "max_seq_len": 32, "vocab_size": 258},
}
LOSS_TOLERANCE = 1e-5
"""Relative, per step. tp x dp computes the same fp32 function as dp: only the order of additions differs
(each row-parallel projection adds two partial products, the data-parallel mean is over 2 ranks' sums rather
than 4), a few units in fp32's last place (~1e-7) per sum; over 16 steps of AdamW at lr 1e-3 the losses
were seen to differ by < 2e-8. 1e-5 leaves room for that drift, and a wrong split (a head or a sample on
the wrong rank, a gradient counted twice) moves the first loss by more than 1e-3."""


def config(
    data_uri: str, root: Path, *, tensor_parallel_size: int, model: dict = LLAMA, steps: int = STEPS
) -> dict:
    """One stage of `steps` steps at global batch 32 on 2 nodes x 2 processes, micro batch 4, checkpointing
    every 4 steps, the tiny Llama (or `model`) under fsdp.

    Micro batch 4 (accumulation 4 at tensor_parallel_size 2, 2 at 1: the noise scale and coherence are still
    measured) rather than 2: every pass costs collectives within the tensor-parallel group and FSDP's
    gathers, and on CI's 2 cores a 16-step run took about 54 CPU-seconds instead of 76."""
    result = tiny_config(
        data_uri=data_uri,
        checkpoint_uri=f"file://{root}/ckpt",
        batch__global_batch_size=32,
        batch__micro_batch_size=4,
        batch__schedule=None,
        train__total_samples=32 * steps,
        train__checkpoint_every_steps=4,
        train__parallelism="fsdp",
        train__measure_coherence=True,
        train__tensor_parallel_size=tensor_parallel_size,
    )
    result["model"] = model
    result["cluster"]["devices_per_node"] = 2
    return result


def train_final(plan: str, out: Path):
    return run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out))


def tp_runs(data_uri: str, tmp_path_factory, *, name: str, **settings) -> dict[int, tuple[Path, str]]:
    """The uninterrupted runs at tensor_parallel_size 1 (dp 4) and 2 (dp 2), each on 2 nodes x 2 processes:
    {tp: (root, log)}; `settings` go to `config`."""
    roots = {}
    for tp in (1, 2):
        root = tmp_path_factory.mktemp(f"{name}{tp}")
        plan = write_plan(root, config(data_uri, root, tensor_parallel_size=tp, **settings))
        document = json.loads(Path(plan).read_text())
        assert document.get("tensor_parallel_size", 1) == tp
        assert [(s["num_nodes"], s["world_size"], s["data_parallel_size"]) for s in document["stages"]] == [
            (2, 4, 4 // tp)
        ]
        result = train_final(plan, root / "out")
        assert result.returncode == 0, result.stdout[-3000:]
        roots[tp] = (root, result.stdout)
    return roots


@pytest.fixture(scope="module")
def runs(demo_data_uri, tmp_path_factory):
    """The Llama's uninterrupted runs at tensor_parallel_size 1 and 2 (`tp_runs`)."""
    return tp_runs(demo_data_uri, tmp_path_factory, name="tp")


def assert_tp_trains_as_dp(runs: dict[int, tuple[Path, str]], *, steps: int) -> tuple[list[dict], str]:
    """The tp 2 x dp 2 run of `tp_runs` trained the dp 4 run's losses, gradient norms, validation loss and final
    weights; returns its metrics and log."""
    (dp_root, _), (tp_root, log) = runs[1], runs[2]
    assert "fsdp: parameters sharded 2 ways, each block split 2 ways (tensor parallel)" in log
    dp = read_metrics(dp_root / "out" / "metrics.jsonl")
    tp = read_metrics(tp_root / "out" / "metrics.jsonl")
    assert len(dp) == len(tp) == steps
    for a, b in zip(dp, tp, strict=True):
        assert (a["consumed_samples"], a["world_size"], b["world_size"]) == (b["consumed_samples"], 4, 2)
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_TOLERANCE), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=LOSS_TOLERANCE), a["step"]
    assert tp[-1]["val_loss"] == pytest.approx(dp[-1]["val_loss"], rel=LOSS_TOLERANCE)
    expected = Checkpointer(uri=f"file://{dp_root}/ckpt").load().full_state()["model"]
    actual = Checkpointer(uri=f"file://{tp_root}/ckpt").load().full_state()["model"]
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.allclose(actual[name], expected[name], rtol=1e-4, atol=1e-6), name
    return tp, log


def test_tp2_x_dp2_trains_as_dp4_does(runs):
    tp, log = assert_tp_trains_as_dp(runs, steps=STEPS)
    assert "batch 32 = 4 x 2 x 4" in log  # micro x data-parallel ranks x accumulation
    # The noise scale from each data-parallel rank's own passes (4 samples each), coherence from two.
    assert sum(r["noise_scale"] is not None for r in tp) > STEPS // 2
    assert all(-1 <= r["gradient_coherence"] <= 1 for r in tp)
    checkpoint = Checkpointer(uri=f"file://{runs[2][0]}/ckpt").load()
    assert checkpoint.meta["tensor_parallel_size"] == 2 and checkpoint.meta["world_size"] == 2


def test_a_tensor_parallel_checkpoint_exports_as_a_hugging_face_llama(runs, tmp_path):
    """The DCP checkpoint of 2 x 2 split ranks, read whole by `batchpilot export`: transformers' Llama gives
    our model's logits."""
    transformers = pytest.importorskip("transformers")
    from test_export_hf_checkpoints import logits_difference

    from batchpilot.models.factory import build_model

    root = runs[2][0]
    exported = run_batchpilot(
        "export", "--plan", str(root / "plan.json"), "--format", "hf", "--out", str(tmp_path)
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert f"exported step {STEPS} ({32 * STEPS} samples)" in exported.stdout
    ours = build_model(factory=LLAMA["factory"], args=LLAMA["args"])
    ours.load_state_dict(Checkpointer(uri=f"file://{root}/ckpt").load().full_state()["model"])
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert logits_difference(theirs, ours, seq=32) <= 1e-4


def test_kill_9_under_fsdp_x_tp_then_resume_is_identical(runs, demo_data_uri, tmp_path, fault_rng):
    plan = write_plan(tmp_path, config(demo_data_uri, tmp_path, tensor_parallel_size=2))
    resumed = kill_9_then_resume(plan, tmp_path, steps=STEPS, fault_rng=fault_rng, kill_after=(5, STEPS - 4))
    assert "resumed from step" in resumed and "under fsdp, each block split 2 ways" in resumed
    assert_same_run(runs[2][0], tmp_path)


def test_a_stage_change_from_1_to_2_nodes_under_tp_trains_every_sample_once(demo_data_uri, tmp_path):
    """Stage 0 (batch 8) on 1 node: one tensor-parallel group, data-parallel size 1; stage 1 (batch 16) on 2
    nodes: 2 groups. The second launch loads the first's checkpoint onto the 2-D mesh (fsdp shards of the
    tensor-parallel parts)."""
    staged = config(demo_data_uri, tmp_path, tensor_parallel_size=2)
    staged["batch"].update(global_batch_size=16, micro_batch_size=8, schedule="0:8 128:16")
    staged["train"].update(total_samples=384, checkpoint_every_steps=8)
    plan = write_plan(tmp_path, staged)
    document = json.loads(Path(plan).read_text())
    assert [(s["num_nodes"], s["data_parallel_size"]) for s in document["stages"]] == [(1, 1), (2, 2)]
    out = tmp_path / "out"
    logs = []
    for stage in ("0", "1"):
        result = run_batchpilot(
            "launch", "--plan", plan, "--stage", stage, "--output-dir", str(out), "--audit"
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        logs.append(result.stdout)
    assert "1 node(s) x 2 process(es)" in logs[0] and "2 node(s) x 2 process(es)" in logs[1]
    assert "resumed from step 16 (128 samples)" in logs[1]
    assert "saved by 1 process(es) under fsdp, each block split 2 ways" in logs[1]
    rows = []
    for path in sorted((out / "audit").glob("positions-rank*.txt")):
        for line in path.read_text().splitlines():
            stage, world, *positions = (int(v) for v in line.split())
            rows.append((stage, world, positions))
    assert {(stage, world) for stage, world, _ in rows} == {(0, 1), (1, 2)}
    positions = sorted(p for _, _, ps in rows for p in ps)
    assert positions == list(range(384))
    manifest = json.loads((Path(demo_data_uri.removeprefix("file://")) / "manifest.json").read_text())
    total = num_samples(num_tokens=manifest["splits"]["train"]["num_tokens"], seq_len=32)
    assert len({sample_at(p, num_samples=total, seed=0) for p in positions}) == 384
    metrics = read_metrics(out / "metrics.jsonl")
    assert [r["global_batch_size"] for r in metrics] == [8] * 16 + [16] * 16
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.1


OOM_STEPS = 4
"""The out-of-memory retry's length: its steps at micro batch 2 cost twice the reference's (accumulation 8),
so it trains only the warmup (128 samples), whose learning rates do not depend on the run's length (the
decay starts after it): its losses are those of the reference run's first 4 steps."""


def test_out_of_memory_under_fsdp_x_tp_ends_the_job_and_the_retry_trains_with_half(
    runs, demo_data_uri, tmp_path
):
    """Rank 0 of a tensor-parallel group runs out of memory above micro batch 2 (inside collectives: the ranks
    cannot agree): the job ends recording the halved size, and the retry trains the same global batches as
    micro batch 2 x 2 data-parallel ranks x 8."""
    plan = write_plan(tmp_path, config(demo_data_uri, tmp_path, tensor_parallel_size=2, steps=OOM_STEPS))
    warmup = json.loads(Path(plan).read_text())["config"]["train"]["warmup_samples"]
    assert warmup >= 32 * OOM_STEPS  # the comparison with the longer reference run holds in the warmup only
    env = {**os.environ, "BATCHPILOT_INJECT_OOM_ABOVE_MICRO_BATCH": "2"}
    out = str(tmp_path / "out")
    first = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", out, env=env)
    assert first.returncode != 0
    assert "ran out of memory at micro_batch_size=4 in final under fsdp" in first.stdout + first.stderr
    assert json.loads((tmp_path / "ckpt" / "micro_batch.json").read_text()) == {"stages": {"0": 2}}
    second = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", out, env=env)
    assert second.returncode == 0, second.stdout[-3000:]
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert {(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in metrics} == {(2, 8)}
    assert len(metrics) == OOM_STEPS
    reference = read_metrics(runs[2][0] / "out" / "metrics.jsonl")[:OOM_STEPS]
    for a, b in zip(metrics, reference, strict=True):
        assert a["lr"] == b["lr"], a["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_TOLERANCE)
