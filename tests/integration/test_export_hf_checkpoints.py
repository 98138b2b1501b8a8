"""`batchpilot export --format hf` of checkpoints the trainer wrote: the GPT trained by 2 DDP ranks (a real
`batchpilot launch`), and a Llama's sharded checkpoint and shard set in GCS (fake-gcs-server)."""

from __future__ import annotations

import pytest
import torch
import yaml

from batchpilot.cli import main
from batchpilot.data.shards import Manifest
from batchpilot.export import export_hf
from batchpilot.models import hf
from batchpilot.models.factory import build_model
from batchpilot.storage import open_storage
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
from batchpilot.train.state import training_state
from helpers import run_batchpilot, tiny_config, write_plan

GPT_ARGS = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}  # tiny_config's


def logits_difference(theirs: torch.nn.Module, ours: torch.nn.Module, *, seq: int) -> float:
    ids = torch.randint(0, 257, (4, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (theirs.eval()(ids).logits - ours.eval()(ids)).abs().max().item()


@pytest.mark.slow
def test_a_gpt_trained_by_two_ddp_ranks_exports_as_gpt2(demo_data_uri, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(
        data_uri=demo_data_uri,
        checkpoint_uri=f"file://{tmp_path}/ckpt",
        batch__global_batch_size=32,
        batch__micro_batch_size=16,
        batch__schedule=None,
        train__total_samples=32 * 6,
        train__parallelism="ddp",
    )
    plan = write_plan(tmp_path, config)
    trained = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--out", str(tmp_path / "out"))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    out = tmp_path / "hf"
    exported = run_batchpilot("export", "--plan", plan, "--format", "hf", "--out", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "exported step 6 (192 samples)" in exported.stdout

    checkpoint = Checkpointer(uri=f"file://{tmp_path}/ckpt").load()
    assert (checkpoint.meta["parallelism"], checkpoint.meta["world_size"]) == ("ddp", 2)
    ours = build_model(factory=hf.GPT_FACTORY, args=GPT_ARGS)
    ours.load_state_dict(checkpoint.full_state()["model"])
    theirs = transformers.GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float32)
    assert logits_difference(theirs, ours, seq=32) <= 1e-4


def test_a_checkpoint_and_tokenizer_in_gcs_export(gcs_bucket, tmp_path):
    """Checkpoint, manifest and tokenizer.json read through the GCS client; the folder is written locally."""
    args = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "n_embd": 32, "max_seq_len": 32, "vocab_size": 257}
    data = open_storage(f"gs://{gcs_bucket}/data")
    tokenizer = {"kind": "huggingface", "file": "tok.json", "sha256": "0" * 64, "eos_token": "</s>"}
    data.write("tokenizer.json", b'{"version": "1.0"}')
    manifest = Manifest(
        dtype="uint16", vocab_size=257, eos_token_id=2, tokenizer=tokenizer, splits={"train": ()}
    )
    data.write("manifest.json", manifest.to_json().encode())
    torch.manual_seed(0)
    model = build_model(factory=hf.LLAMA_FACTORY, args=args)
    Checkpointer(uri=f"gs://{gcs_bucket}/ckpt").save_sharded(
        step=3, consumed_samples=48, state=training_state(model, torch.optim.AdamW(model.parameters())),
        rng=capture_rng_state(),
    )  # fmt: skip
    config = tiny_config(data_uri=f"gs://{gcs_bucket}/data", checkpoint_uri=f"gs://{gcs_bucket}/ckpt")
    config["model"] = {"factory": hf.LLAMA_FACTORY, "args": args}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert (
        main(["plan", "--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "plan.json")]) == 0
    )
    result = export_hf(plan=tmp_path / "plan.json", out=tmp_path / "hf")
    assert result.step == 3
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == b'{"version": "1.0"}'
    hf_config, state = hf.read_hf_checkpoint(tmp_path / "hf")
    assert hf_config["eos_token_id"] == 2
    assert torch.equal(state["model.embed_tokens.weight"], model.tok_embeddings.weight)
