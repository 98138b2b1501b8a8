"""`batchpilot export --format hf` from a run document and its sharded checkpoint (written here on one
process, as the trainer's checkpointer writes it): the step chosen, the dtype, the tokenizer of the shard set,
and a folder that is complete or absent."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import yaml

from batchpilot import export
from batchpilot.cli import main
from batchpilot.models import hf
from batchpilot.models.factory import build_model
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
from batchpilot.train.state import training_state
from helpers import tiny_config, write_manifest
from hf_files import bpe_tokenizer_json

LLAMA_ARGS = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 32, "vocab_size": 257}
HF_TOKENIZER = {"kind": "huggingface", "file": "tok.json", "sha256": "0" * 64, "eos_token": "</s>"}


def make_run(root: Path, *, tokenizer: dict | None = None, args: dict = LLAMA_ARGS) -> str:
    """plan.json of a tiny Llama config (a shard set's manifest, no shards) under `root`; returns its path."""
    data_uri = write_manifest(root / "data", tokenizer=tokenizer)
    config = tiny_config(data_uri=data_uri, checkpoint_uri=f"file://{root}/ckpt")
    config["model"] = {"factory": hf.LLAMA_FACTORY, "args": args}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    plan = root / "plan.json"
    assert main(["plan", "--config", str(root / "config.yaml"), "--out", str(plan)]) == 0
    return str(plan)


def save_checkpoint(root: Path, step: int, *, seed: int, args: dict = LLAMA_ARGS) -> torch.nn.Module:
    """A sharded checkpoint of a model with random weights (model and optimizer state, as training saves)."""
    torch.manual_seed(seed)
    model = build_model(factory=hf.LLAMA_FACTORY, args=args).eval()
    optimizer = torch.optim.AdamW(model.parameters())
    Checkpointer(uri=f"file://{root}/ckpt").save_sharded(
        step=step, consumed_samples=step * 16, state=training_state(model, optimizer), rng=capture_rng_state()
    )
    return model


@pytest.fixture
def run(tmp_path: Path) -> tuple[str, dict[int, torch.nn.Module]]:
    plan = make_run(tmp_path)
    return plan, {step: save_checkpoint(tmp_path, step, seed=step) for step in (2, 5)}


def test_the_latest_checkpoint_exports_and_transformers_computes_its_logits(tmp_path, run):
    transformers = pytest.importorskip("transformers")
    plan, models = run
    result = export.export_hf(plan=plan, out=tmp_path / "hf")
    assert (result.step, result.consumed_samples, result.architecture) == (5, 80, "LlamaForCausalLM")
    assert [name for name, _ in result.files] == [
        "config.json",
        "model.safetensors",
        "generation_config.json",
    ]
    assert result.num_params == sum(p.numel() for p in models[5].parameters())
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(ids).logits - models[5](ids)).abs().max().item() <= 1e-4
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 256
    assert "raw bytes" in result.tokenizer_note and "256" in result.tokenizer_note
    assert not any((tmp_path / "hf").glob("tokenizer*"))


def test_step_chooses_the_checkpoint(tmp_path, run):
    plan, models = run
    export.export_hf(plan=plan, out=tmp_path / "hf", step=2)
    _, state = hf.read_hf_checkpoint(tmp_path / "hf")
    exported = state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(exported, models[2].blocks[0].attention.wq.weight)
    assert not torch.equal(exported, models[5].blocks[0].attention.wq.weight)


def test_bf16_weights(tmp_path, run):
    plan, models = run
    export.export_hf(plan=plan, out=tmp_path / "hf", dtype="bf16")
    config, state = hf.read_hf_checkpoint(tmp_path / "hf")
    assert config["torch_dtype"] == "bfloat16"
    assert {tensor.dtype for tensor in state.values()} == {torch.bfloat16}
    assert torch.equal(state["model.norm.weight"], models[5].norm.weight.to(torch.bfloat16))


def test_the_shard_sets_tokenizer_json_is_copied_and_auto_tokenizer_loads_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    text = "the batch grows as the noise scale grows; the node pool follows the batch"
    tokenizer_json = bpe_tokenizer_json([text] * 20, vocab_size=200, special_tokens=["<unk>", "</s>"])
    plan = make_run(tmp_path, tokenizer=HF_TOKENIZER)
    (tmp_path / "data" / "tokenizer.json").write_bytes(tokenizer_json)
    save_checkpoint(tmp_path, 1, seed=1)
    result = export.export_hf(plan=plan, out=tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer_json
    assert [name for name, _ in result.files][-2:] == ["tokenizer.json", "tokenizer_config.json"]
    assert result.tokenizer_note.startswith("tokenizer.json copied from file://")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    expected = (
        tokenizers.Tokenizer.from_str(tokenizer_json.decode()).encode(text, add_special_tokens=False).ids
    )
    assert loaded(text, add_special_tokens=False)["input_ids"] == expected
    assert (loaded.eos_token, loaded.eos_token_id) == ("</s>", 1)


def test_a_tokenizer_the_shard_set_does_not_hold_is_said(tmp_path):
    plan = make_run(tmp_path, tokenizer=HF_TOKENIZER)
    save_checkpoint(tmp_path, 1, seed=1)
    result = export.export_hf(plan=plan, out=tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert "holds no tokenizer.json; copy tok.json" in result.tokenizer_note


def test_force_replaces_a_folder_and_a_failure_leaves_nothing(tmp_path, run, monkeypatch):
    plan, _ = run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("old")
    export.export_hf(plan=plan, out=out, force=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").exists()

    def fail_midway(folder, *args, **kwargs):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "write_hf_checkpoint", fail_midway)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OSError, match="disk full"):
        export.export_hf(plan=plan, out=tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial folder, no new one
    with pytest.raises(OSError, match="disk full"):
        export.export_hf(plan=plan, out=out, force=True)
    assert (out / "model.safetensors").exists()  # the previous export stays when the new one fails


def test_files_get_the_modes_a_plain_write_gives(tmp_path, run):
    plan, _ = run
    export.export_hf(plan=plan, out=tmp_path / "hf")
    assert (tmp_path / "hf").stat().st_mode & 0o777 == (tmp_path / "data").stat().st_mode & 0o777
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == (
        (tmp_path / "data" / "manifest.json").stat().st_mode & 0o777
    )


def test_export_reads_one_file_shard_at_a_time(tmp_path, run, monkeypatch):
    """With 40 KB shards the model (about 0.5 MB in fp32) is written as several files, and the checkpoint is
    read once per file, only that file's tensors (with the tied embedding's head, when tied): the whole model
    is never in memory. The files hold the checkpoint's weights, as the in-memory conversion gives them."""
    plan, models = run
    limit = 40_000
    monkeypatch.setattr(
        hf, "write_hf_checkpoint", functools.partial(hf.write_hf_checkpoint, max_shard_bytes=limit)
    )
    reads: list[int] = []
    original = export.CheckpointWeights._read

    def counting(self, names):
        state = original(self, names)
        reads.append(sum(t.numel() * t.element_size() for t in state.values()))
        return state

    monkeypatch.setattr(export.CheckpointWeights, "_read", counting)
    export.export_hf(plan=plan, out=tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / hf.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and len(reads) == len(files)
    largest = max(p.numel() * 4 for p in models[5].parameters())
    assert max(reads) <= max(limit, largest)
    whole = sum(p.numel() * 4 for p in models[5].parameters())
    assert sum(reads) == whole  # every tensor read exactly once
    expected = hf.to_hf_state_dict(hf.LLAMA_FACTORY, LLAMA_ARGS, models[5].state_dict())
    from safetensors.torch import load_file

    written = {}
    for name in files:
        written.update(load_file(str(tmp_path / "hf" / name)))
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
