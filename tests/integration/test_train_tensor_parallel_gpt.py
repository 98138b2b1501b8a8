"""The GPT's tensor-parallel plan in the trainer (train/tensor_parallel.py): 2 local nodes x 2 processes (gloo),
each node one tensor-parallel group of 2, fsdp over the 2 groups, a GPT with biases.

- It trains as dp=4 does on the same 4 processes: the same losses (the tolerance is the Llama's, reasoned in
  test_train_tensor_parallel.py), gradient norms and final weights. The fused QKV projection stays whole on
  each device, which multiplies its heads' rows of Q, K and V only; the position embedding stays whole, each
  device adding its part of the sequence's rows.
- Its DCP checkpoint exports as a Hugging Face GPT-2.

What holds for every model with a plan (a stage change across node counts, kill -9 and resume, an OOM and
its retry) is tested with the Llama in test_train_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from test_train_tensor_parallel import assert_tp_trains_as_dp, tp_runs

from batchpilot.train.checkpoint import Checkpointer
from helpers import run_batchpilot

pytestmark = pytest.mark.slow

STEPS = 8
GPT = {
    "factory": "batchpilot.models.gpt:build",
    "args": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32, "vocab_size": 258, "bias": True},
}


@pytest.fixture(scope="module")
def runs(demo_data_uri, tmp_path_factory):
    """The GPT's uninterrupted runs at tensor_parallel_size 1 and 2, 8 steps each."""
    return tp_runs(demo_data_uri, tmp_path_factory, name="gpt-tp", model=GPT, steps=STEPS)


def test_a_gpt_at_tp2_x_dp2_trains_as_dp4_does(runs):
    assert_tp_trains_as_dp(runs, steps=STEPS)


def test_a_tensor_parallel_gpt_checkpoint_exports_as_a_hugging_face_gpt2(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_export_hf_checkpoints import logits_difference

    from batchpilot.models.factory import build_model

    root = runs[2][0]
    exported = run_batchpilot(
        "export", "--plan", str(root / "plan.json"), "--format", "hf", "--out", str(tmp_path)
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    ours = build_model(factory=GPT["factory"], args=GPT["args"])
    ours.load_state_dict(Checkpointer(uri=f"file://{root}/ckpt").load().full_state()["model"])
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert logits_difference(theirs, ours, seq=32) <= 1e-4
