"""explore's effective-batch study with `train.init_from`: the study's model starts from the Hugging Face
checkpoint (its first gradient is the one transformers computes on the same batches), explore.json and
explore.html say so, and the fingerprint makes an explore.json of another checkpoint stale.

The probes are a fake device (their timing does not depend on the weights); the study is the real process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from batchpilot.config import Config, explore_fingerprint, parse_config
from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.explore.records import ProbeRequest, ProbeResult
from batchpilot.explore.runner import run_exploration
from batchpilot.plan.inputs import explore_problems
from hf_files import LLAMA_ARGS, LLAMA_FACTORY, write_hf_llama

SEQ_LEN = 32
MICRO = 2
MULTIPLIER = 2


def llama_config(data_uri: str, *, init_from: str | None, args: dict | None = None) -> Config:
    """The Llama of `LLAMA_ARGS` on the demo data; a study of one batch of 2 micro batches of 2, no training
    step first (its gradient is the checkpoint's own)."""
    return parse_config(
        {
            "name": "explore-init-from",
            "model": {"factory": LLAMA_FACTORY, "args": args or LLAMA_ARGS},
            "data": {"uri": data_uri, "seq_len": SEQ_LEN},
            "cluster": {"devices_per_node": 1, "max_nodes": 1},
            "batch": {"global_batch_size": 16, "micro_batch_size": "explore"},
            # parallelism ddp, not auto: auto's probe_parallelism would run the plan's checks anyway
            "train": {
                "total_samples": 64,
                "lr": 1.0e-3,
                "checkpoint_uri": "file:///nowhere",
                "init_from": init_from,
                "parallelism": "ddp",
            },
            "explore": {
                "accumulation_multipliers": [MULTIPLIER],
                "study_train_steps": 0,
                "study_measure_batches": 1,
                "study_timeout_s": 120,
            },
        }
    )


def fake_device(request: ProbeRequest) -> ProbeResult:
    """Every micro batch fits at 100 samples/s; the speed probes never load the checkpoint."""
    assert request.init_from is None, "a speed probe loaded train.init_from"
    micro = request.micro_batch_size
    return ProbeResult(
        micro_batch_size=micro,
        activation_checkpointing=request.activation_checkpointing,
        compile=False,
        fits=True,
        peak_memory_bytes=2**20,
        step_time_s=micro / 100,
        tokens_per_s=micro * SEQ_LEN * 100 / micro,
        samples_per_s=100.0,
        step_times_s=[micro / 100] * 3,
        repeats=3,
    )


def explore(config: Config, out: Path) -> dict:
    run_exploration(config=config, output_dir=out, micro_batch_sizes=[MICRO], measure=fake_device)
    return json.loads((out / "explore.json").read_text())


def transformers_grad_norm(folder: Path, config: Config) -> float:
    """|mean gradient| of the study's first 2 micro batches, computed by transformers' LlamaForCausalLM loaded
    from `folder` (fp32): what the study's 2x row measures when its model starts from the checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    loader = TokenLoader(
        uri=config.data.uri, seq_len=SEQ_LEN, seed=config.train.seed, rank=0, world_size=1, local_world_size=1,
        split=config.data.split, verify_checksums=config.data.verify_checksums,
    )  # fmt: skip
    try:
        batches = loader.micro_batches(
            consumed_samples=0,
            global_batch_size=MICRO * MULTIPLIER,
            micro_batch_size=MICRO,
            gradient_accumulation_steps=MULTIPLIER,
        )
    finally:
        loader.close()
    for batch in batches:
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
    # Rotary layouts permute rows of q and k: the norm over every parameter does not change.
    return sum(float((p.grad / MULTIPLIER).square().sum()) for p in model.parameters()) ** 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "llama", std=0.3)


@pytest.mark.slow
def test_the_study_measures_the_init_from_checkpoint_not_a_random_model(tmp_path, demo_data_uri, checkpoint):
    config = llama_config(demo_data_uri, init_from=str(checkpoint))
    expected = transformers_grad_norm(checkpoint, config)
    loaded = explore(config, tmp_path / "loaded")
    random = explore(llama_config(demo_data_uri, init_from=None), tmp_path / "random")

    assert loaded["noise_scale"]["weights"] == f"init_from {checkpoint}"
    assert loaded["fingerprint"]["train.init_from"] == str(checkpoint)
    assert loaded["noise_scale"]["per_multiplier"][0]["grad_norm"] == pytest.approx(expected, rel=1e-4)
    html = (tmp_path / "loaded" / "explore.html").read_text()
    assert f"Measured on the model&#x27;s weights from: init_from {checkpoint}." in html

    assert random["noise_scale"]["weights"] == "random init"
    assert random["fingerprint"]["train.init_from"] is None
    assert random["noise_scale"]["per_multiplier"][0]["grad_norm"] != pytest.approx(expected, rel=0.1)


def test_a_checkpoint_of_another_shape_is_refused_before_any_probe(tmp_path, demo_data_uri, checkpoint):
    config = llama_config(demo_data_uri, init_from=str(checkpoint), args={**LLAMA_ARGS, "n_layer": 3})

    def no_probe(request: ProbeRequest) -> ProbeResult:
        raise AssertionError("probed before train.init_from was checked")

    with pytest.raises(BatchpilotError) as raised:
        run_exploration(config=config, output_dir=tmp_path, micro_batch_sizes=[MICRO], measure=no_probe)
    assert str(raised.value) == (
        f"model.args.n_layer: is 3 but {checkpoint / 'config.json'} has num_hidden_layers 2 "
        "(fix: set model.args.n_layer: 2)"
    )


def test_another_init_from_changes_explore_fingerprint(checkpoint):
    uri = "file:///nowhere"
    prints = [
        explore_fingerprint(llama_config(uri, init_from=source))
        for source in (None, str(checkpoint), "gs://bucket/other-llama")
    ]
    assert [p["train.init_from"] for p in prints] == [None, str(checkpoint), "gs://bucket/other-llama"]
    assert prints[0] | {"train.init_from": str(checkpoint)} == prints[1]
    # plan refuses the explore.json measured from another checkpoint (or from random weights)
    problems = explore_problems(llama_config(uri, init_from=str(checkpoint)), {"fingerprint": prints[0]})
    assert [str(p) for p in problems] == [
        f"--explore: was measured for another model or setting than this config's: train.init_from None there, "
        f"{str(checkpoint)!r} here (fix: run `batchpilot explore` with this config, or plan with the config "
        "explore measured)"
    ]
