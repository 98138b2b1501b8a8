"""Helpers for tests that run batchpilot as a user would: real processes, real files."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run_batchpilot(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600
):
    """Runs `python -m batchpilot ARGS` in a real process and returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "batchpilot", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def write_manifest(
    folder: Path, *, vocab_size: int = 257, tokenizer: dict | None = None, num_tokens: int = 10**7
) -> str:
    """A shard set's manifest.json in `folder` listing one train shard of `num_tokens` tokens that is not
    there (what `config check` and `plan` read of local data); returns the folder's file:// URI."""
    from batchpilot.data.shards import Manifest, ShardEntry

    folder.mkdir(parents=True, exist_ok=True)
    shard = ShardEntry(name="train-00000.bin", num_tokens=num_tokens, num_bytes=2 * num_tokens, crc32c=0)
    manifest = Manifest(
        dtype="uint16",
        vocab_size=vocab_size,
        eos_token_id=vocab_size - 1,
        tokenizer=tokenizer or {"kind": "bytes"},
        splits={"train": (shard,)},
    )
    (folder / "manifest.json").write_text(manifest.to_json())
    return f"file://{folder}"


def tiny_config(*, data_uri: str, checkpoint_uri: str, **overrides: object) -> dict:
    """A tiny GPT config whose plan has three stages: 16 (1 node) -> 32 (2 nodes) -> 64 (2 nodes)."""
    config = {
        "name": "tiny",
        "model": {"args": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257}},
        "data": {"uri": data_uri, "seq_len": 32},
        "cluster": {"devices_per_node": 1, "max_nodes": 2},
        "batch": {"global_batch_size": 64, "micro_batch_size": 16, "schedule": "0:16 320:32 960:64"},
        "train": {
            "total_samples": 2048,
            "lr": 1.0e-3,
            "warmup_samples": 128,
            "checkpoint_uri": checkpoint_uri,
        },
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return config


def gke_a3_config(**cluster: object) -> dict:
    """The tiny model on a GKE pool `gpu` of a3-highgpu-8g nodes (8 H100s each; project proj, cluster
    train), micro batch 2, data and checkpoints in GCS (a gke config refuses local paths); `cluster`
    overrides cluster settings."""
    config = tiny_config(data_uri="gs://bucket/data", checkpoint_uri="gs://bucket/ckpt")
    config["cluster"].update(
        backend="gke", project="proj", location="us-central1", cluster_name="train", node_pool="gpu",
        image="batchpilot:0.1.0", machine_type="a3-highgpu-8g", accelerator_type="nvidia-h100-80gb",
        devices_per_node=8, **cluster,
    )  # fmt: skip
    config["batch"]["micro_batch_size"] = 2
    if cluster.get("provisioning") == "flex-start":
        config["explore"] = {
            "study": False
        }  # flex-start refuses an explore task (its pool has no node for it)
    return config


def write_plan(folder: Path, config: dict) -> str:
    """Writes config.yaml and, through the real `batchpilot plan` command, plan.json into `folder`; returns the
    plan's path (the run document carries the config for `launch` and `train`).

    The command runs in this process (`batchpilot.cli.main`, its output captured, the `batchpilot` logger's
    console set-up undone after): as a process of its own it cost each of about 80 callers 1.6 CPU-seconds,
    mostly importing torch, on CI's 2 cores."""
    import contextlib
    import io
    import logging

    from batchpilot.cli import main

    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    plan_path = folder / "plan.json"
    logger = logging.getLogger("batchpilot")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", "--config", str(config_path), "--out", str(plan_path), "--force"])
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    assert code == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]
    return str(plan_path)


def processes_with(marker: str) -> list[tuple[int, list[str], dict[str, str]]]:
    """(pid, argv, environment) of this machine's processes whose command line contains `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if marker not in " ".join(argv):
                continue
            raw = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw if "=" in item)
        found.append((int(proc.name), argv, env))
    return found


def trainer_ranks(output_dir: str) -> dict[int, int]:
    """rank -> pid of the `batchpilot train` worker processes writing to `output_dir`."""
    ranks = {}
    for pid, argv, env in processes_with(output_dir):
        if "batchpilot" in argv and "train" in argv and "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


def launch(plan: str, out: Path, **kwargs) -> subprocess.Popen:
    """Starts `batchpilot launch --stage final` of `plan` in the background (stdout and stderr together)."""
    args = ["launch", "--plan", plan, "--stage", "final", "--output-dir", str(out)]
    return subprocess.Popen(
        [sys.executable, "-m", "batchpilot", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def wait_for_steps(metrics: Path, steps: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Waits until `metrics` holds `steps` lines, failing with the job's output if it ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"{metrics} did not reach {steps} steps")


def wait_for_checkpoint(uri: str, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """Waits until a checkpoint under `uri` is committed and returns its step, failing with the job's output
    if it ends first (saves are asynchronous: on a loaded machine the first may commit steps after it began)."""
    from batchpilot.train.checkpoint import Checkpointer

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step = Checkpointer(uri=uri).latest_step()
        if step is not None:
            return step
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint committed under {uri} within {timeout_s:g} s")


SCHEMAS = REPO / "tests" / "fixtures" / "schemas"
"""Published CRDs the rendered objects are validated against (sources in its README.md)."""


def crd_schema(filename: str, *, version: str | None = None) -> dict:
    """The OpenAPI v3 schema of a CRD file under SCHEMAS: `version`'s, or the first served version's."""
    crd = _load_crd(filename)
    versions = crd["spec"]["versions"]
    chosen = next(v for v in versions if v["name"] == version) if version else versions[0]
    return chosen["schema"]["openAPIV3Schema"]


@functools.cache
def _load_crd(filename: str) -> dict:
    # The C loader: the CRDs are large and the pure-Python loader takes seconds.
    return yaml.load((SCHEMAS / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def validate_crd(obj: dict, filename: str, *, version: str | None = None) -> None:
    """Validates `obj` against a published CRD's schema (jsonschema Draft 7 covers what they use; the
    Kubernetes `x-kubernetes-*` extensions are ignored)."""
    import jsonschema

    # Not jsonschema.validate: it would first meta-validate the large schema, which costs seconds a call.
    jsonschema.Draft7Validator(crd_schema(filename, version=version)).validate(obj)


def assert_identical(expected: object, actual: object, where: str = "") -> None:
    """The same nested state: tensors bit for bit, everything else equal."""
    import torch

    if isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), where
        for key in expected:
            assert_identical(expected[key], actual[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(expected) == len(actual), where
        for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_identical(a, b, f"{where}/{index}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), where
    else:
        assert expected == actual, where


# Throughput per device relative to micro batch 1, measured pass by pass (explore.json's relative_throughput).
EXPLORED_SPEEDS = {1: 1.0, 2: 1.3, 4: 1.5, 8: 1.7, 16: 1.71}


def synthetic_explore_json(tmp_path: Path) -> str:
    """An exploration whose fastest size (16) the 24-sample first stage cannot split: it plans with 4."""
    probes = [
        {
            "micro_batch_size": micro,
            "activation_checkpointing": False,
            "compile": False,
            "fits": True,
            "samples_per_s": 100.0 * speed,
            "tokens_per_s": 3200.0 * speed,
            "step_time_s": micro / (100.0 * speed),
            "relative_throughput": None if micro == 1 else speed,
            "peak_memory_bytes": 2**20 * (10 + micro),
        }
        for micro, speed in EXPLORED_SPEEDS.items()
    ]
    document = {
        "probes": probes,
        "recommendation": {
            "micro_batch_size": 16, "activation_checkpointing": False, "compile": False,
            "plan_compatible_micro_batch_size": 4, "plan_compatible_activation_checkpointing": False,
            "plan_compatible_compile": False,
        },
    }  # fmt: skip
    path = tmp_path / "explore.json"
    path.write_text(json.dumps(document))
    return str(path)


def kill_9_then_resume(plan: str, root: Path, *, steps: int, fault_rng, kill_after: tuple[int, int]) -> str:
    """`launch --stage final` of `plan` (checkpoints in `root`/ckpt, output in `root`/out), kill -9 of a
    random trainer rank after a random step in `kill_after` (inclusive) and a committed checkpoint, the job's
    failure before the run's end, then the same launch again;
    returns the resumed launch's output."""
    import os
    import signal

    from batchpilot.train.checkpoint import Checkpointer

    out = root / "out"
    proc = launch(plan, out)
    wait_for_steps(out / "metrics.jsonl", fault_rng.randint(*kill_after), proc)
    # the resume must have a checkpoint to start from: saves are asynchronous, and on a loaded machine the
    # first committed only after the step the kill was drawn for (a clean-clone CI run, hsdp, 2026-11-29)
    wait_for_checkpoint(f"file://{root}/ckpt", proc)
    ranks = trainer_ranks(str(out))
    os.kill(ranks[fault_rng.choice(sorted(ranks))], signal.SIGKILL)
    # the job ends once torchrun has stopped the other ranks (blocked in a collective with the killed one);
    # a clean-clone CI run on 2 loaded cores once took over 120 s for that under fsdp x tp (4 ranks)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, output
    assert Checkpointer(uri=f"file://{root}/ckpt").latest_step() < steps
    result = run_batchpilot("launch", "--plan", plan, "--stage", "final", "--output-dir", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def assert_same_run(reference: Path, root: Path) -> None:
    """`root`'s final checkpoint (model and AdamW state) bit for bit `reference`'s, and its metrics.jsonl's
    steps equal (folders as `kill_9_then_resume` uses them)."""
    from batchpilot.runstate import read_metrics
    from batchpilot.train.checkpoint import Checkpointer

    expected = Checkpointer(uri=f"file://{reference}/ckpt").load().full_state()
    assert_identical(expected, Checkpointer(uri=f"file://{root}/ckpt").load().full_state())
    assert expected["optimizer"]["state"]
    fields = ("step", "consumed_samples", "loss", "lr", "grad_norm", "noise_scale", "gradient_coherence")
    metrics = read_metrics(root / "out" / "metrics.jsonl")
    expected_metrics = read_metrics(reference / "out" / "metrics.jsonl")
    assert [[r[f] for f in fields] for r in metrics] == [[r[f] for f in fields] for r in expected_metrics]


def start_async_save(checkpointer, step: int, weights, *, side: bool = True, last: bool = False) -> str:
    """An asynchronous save of a one-tensor model `{"w": weights}` at `step` (16 samples a step), with rank 0's
    `metrics.jsonl` side object when `side`, the launch's last when `last`; returns the step folder's URI."""
    from batchpilot.train.checkpoint import capture_rng_state

    return checkpointer.start_save_sharded(
        step=step,
        consumed_samples=step * 16,
        state={"model": {"w": weights}, "optimizer": {"state": {}, "param_groups": []}},
        rng=capture_rng_state(),
        side_objects={"metrics.jsonl": f"step {step}\n".encode()} if side else None,
        last=last,
    )
