"""`train.init_from` under runtime xla: stage 0 on 2 virtual XLA devices (1 node) starts from a Hugging Face Llama
checkpoint (its first step's loss is the loss transformers computes on that batch), and the next stage resumes
on 2 nodes from the run's own checkpoint without reading the Hugging Face folder (removed by then). The folder is
local, or in GCS (fake-gcs-server through the real client), where the host reads it by byte ranges, one tensor
at a time, and keeps no copy on the node."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from xla_helpers import metrics, run_xla, xla_config

from helpers import write_plan

LLAMA_ARGS = {
    "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "max_seq_len": 64, "vocab_size": 300,
    "ffn_hidden_size": 128, "rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False,
}  # fmt: skip


@pytest.fixture
def gcs_client(tmp_path_factory, monkeypatch):
    """A fake-gcs-server on loopback (as tests/integration's fixture), the trainers pointed at it."""
    from gcs_server import gcs_server_running
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    with gcs_server_running(log_path=tmp_path_factory.mktemp("fake-gcs-server") / "server.log") as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "batchpilot-test")
        yield storage.Client(project="batchpilot-test", credentials=AnonymousCredentials())


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_stage_0_on_xla_starts_from_the_checkpoint_and_a_resume_does_not_reload_it(
    demo_data_uri, tmp_path, request, monkeypatch, where
):
    # The eager trainer's test builds the checkpoint and the reference loss the same way.
    from test_train_init_from import first_batch_loss, write_checkpoint

    hf = write_checkpoint(tmp_path / "hf")
    source = str(hf)
    if where == "gcs":
        client = request.getfixturevalue("gcs_client")
        client.create_bucket("weights")
        for path in hf.iterdir():
            client.bucket("weights").blob(f"llama/{path.name}").upload_from_filename(str(path))
        source = "gs://weights/llama"
    cache = tmp_path / "node-cache"
    monkeypatch.setenv("BATCHPILOT_INIT_FROM_CACHE", str(cache))
    seq_len = 32
    config = xla_config(
        demo_data_uri,
        tmp_path,
        data__seq_len=seq_len,
        batch__global_batch_size=16,
        batch__micro_batch_size=4,
        batch__schedule="0:8 32:16",
        train__total_samples=64,
        train__warmup_samples=16,  # below the run's 64 samples (plan's check); step 1's loss is before any update
        train__init_from=source,
        train__eval_samples=0,
    )
    config["model"] = {"factory": "batchpilot.models.llama:build", "args": LLAMA_ARGS}
    plan = write_plan(tmp_path, config)
    expected = first_batch_loss(hf, data_uri=demo_data_uri, global_batch_size=8)
    assert abs(expected - math.log(300)) > 0.5  # far from an untrained model's loss: the check can fail

    output = run_xla(plan, "0", tmp_path / "out", num_devices=2)
    assert f"initialized the model from {source} (21 tensors of a Hugging Face Llama checkpoint)" in output
    if where == "gcs":
        weight_bytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        assert (
            f"train.init_from {source}: read {weight_bytes / 2**20:.1f} MiB, by ranges, one tensor at a time"
            in output
        )
    assert not cache.exists()  # no copy on the node
    records = metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[0]["runtime"] == "xla"
    assert records[0]["loss"] == pytest.approx(expected, abs=1e-4)

    shutil.rmtree(hf)
    resumed = run_xla(plan, "final", tmp_path / "out", num_devices=4)  # the final stage's 2 nodes
    assert f"train.init_from {source} not loaded: resuming from step 4's checkpoint" in resumed
    assert [r["step"] for r in metrics(tmp_path / "out")] == [1, 2, 3, 4, 5, 6]


@pytest.fixture(autouse=True)
def _integration_tests_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "integration"))
