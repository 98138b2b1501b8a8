"""Issue #26: the Llama demo as a whole local pipeline, then `batchpilot export --format hf` of its final
checkpoint (written by 2 FSDP ranks), which transformers loads and runs to the logits of batchpilot's model.
Budget: the pipeline about 45 s on 2 cores, the export and the check a few seconds more (90 s at most)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from test_local_pipeline import run_pipeline

from batchpilot.models.factory import build_model
from batchpilot.plan.rundoc import read_run_document
from batchpilot.train.checkpoint import Checkpointer
from helpers import REPO, run_batchpilot

pytestmark = pytest.mark.slow


def test_the_llama_demo_exports_and_transformers_reproduces_its_logits(demo_data_uri, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = yaml.safe_load((REPO / "configs" / "demo_llama.yaml").read_text())
    config["data"]["uri"] = demo_data_uri
    config["train"]["checkpoint_uri"] = f"file://{tmp_path / 'ckpt'}"
    run = tmp_path / "run"
    result = run_pipeline(config, run)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]

    out = tmp_path / "hf"
    exported = run_batchpilot("export", "--plan", str(run / "plan.json"), "--format", "hf", "--out", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "exported step 80 (2,048 samples)" in exported.stdout
    assert "raw bytes" in exported.stdout  # the demo's byte-level vocabulary: no tokenizer file
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]

    # batchpilot's model from the final checkpoint, read through the checkpoint's own full-state path.
    document = read_run_document(run / "plan.json")
    checkpoint = Checkpointer(uri=document.config.train.checkpoint_uri).load()
    assert (checkpoint.step, checkpoint.meta["parallelism"], checkpoint.meta["world_size"]) == (80, "fsdp", 2)
    ours = build_model(factory=document.config.model.factory, args=document.config.model.args)
    ours.load_state_dict(checkpoint.full_state()["model"])
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256
    ids = torch.randint(0, 257, (4, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (theirs.eval()(ids).logits - ours.eval()(ids)).abs().max().item()
    assert difference <= 1e-4
