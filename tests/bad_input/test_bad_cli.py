"""Issue #24, the command line's own mistakes: output paths that cannot be written, a reader that goes away,
silent acceptances, a failed local run's last line and the folder it leaves."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import no_debris, run_cli

import batchpilot.kfp.local
from batchpilot.errors import BatchpilotError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO = str(CONFIGS / "demo.yaml")
NEMO = str(CONFIGS / "nemo_gpt3_5b.yaml")


@pytest.fixture
def local_config(tmp_path) -> str:
    """The demo config on a small real shard set (byte-level, as the demo model's vocabulary)."""
    data = tmp_path / "data"
    text = tmp_path / "text.txt"
    text.write_text("a few words to tokenize\n" * 2000)  # 375 samples of 128: more than one batch of 64
    prepared = run_cli(
        "data", "prepare", str(text), "--out", f"file://{data}", "--validation-fraction", "0", "--no-progress"
    )
    assert prepared.code == 0, prepared.stderr
    config = yaml.safe_load(Path(DEMO).read_text())
    config["data"]["uri"] = f"file://{data}"
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture
def plan_file(tmp_path_factory, local_config) -> str:
    """plan.json of the demo config on its real shard set (a plan refuses a data.uri with no shard set)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    planned = run_cli("plan", "--config", local_config, "--micro-batch-size", "16", "--out", str(path))
    assert planned.code == 0, planned.stderr
    return str(path)


# --- output paths that cannot be written: one line before any work ----------------------------------------


@pytest.mark.parametrize(
    "command",
    [["plan", "--config", NEMO], ["compile", "--config", NEMO]],
    ids=["plan", "compile"],
)
def test_an_output_file_that_is_a_folder(command, tmp_path):
    with no_debris(tmp_path):
        outcome = run_cli(*command, "--out", str(tmp_path))
    outcome.assert_refused("--out", f"{tmp_path} is a folder")


@pytest.mark.parametrize(
    "command",
    [["plan", "--config", NEMO], ["compile", "--config", NEMO]],
    ids=["plan", "compile"],
)
def test_an_output_file_below_a_file(command, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    with no_debris(tmp_path):
        outcome = run_cli(*command, "--out", str(blocker / "plan.json"))
    outcome.assert_refused("--out", f"{blocker} is a file")


def test_compile_does_not_overwrite_without_force(tmp_path):
    existing = tmp_path / "pipeline.yaml"
    existing.write_text("mine\n")
    with no_debris(tmp_path):
        outcome = run_cli("compile", "--config", DEMO, "--out", str(existing))
    outcome.assert_refused("--out", "exists", "--force")
    assert run_cli("compile", "--config", DEMO, "--out", str(existing), "--force").code == 0
    assert existing.read_text().startswith("# PIPELINE DEFINITION")


@pytest.mark.parametrize("command", ["explore", "run"])
def test_an_output_folder_that_is_a_file(command, tmp_path, local_config):
    blocker = tmp_path / "out"
    blocker.write_text("x")
    with no_debris(tmp_path):
        outcome = run_cli(command, "--config", local_config, "--out", str(blocker))
    outcome.assert_refused("--out", f"{blocker} is a file, not a folder")


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_trainer_output_folder_that_is_a_file(command, tmp_path, plan_file):
    blocker = tmp_path / "out"
    blocker.write_text("x")
    with no_debris(tmp_path):
        outcome = run_cli(command, "--plan", plan_file, "--stage", "0", "--out", str(blocker))
    outcome.assert_refused("--out", f"{blocker} is a file, not a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
@pytest.mark.parametrize(
    "command",
    [["plan", "--config", NEMO, "--out"], ["explore", "--config", NEMO, "--out"]],
    ids=["plan", "explore"],
)
def test_an_output_in_a_folder_without_write_permission(command, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with no_debris(tmp_path):
            outcome = run_cli(*command, str(locked / "new"))
    finally:
        locked.chmod(0o700)
    outcome.assert_refused("--out", f"{locked} is not writable")


# --- a reader that goes away -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["config", "schema"], 141),  # 128 + SIGPIPE, what a shell reports for `yes | head -1`'s yes
        # The table is drawn by rich, which ends a broken pipe with exit 1 itself; the log line before it
        # meets the closed pipe first.
        (["plan", "--config", NEMO], 1),
    ],
    ids=["config schema", "plan table"],
)
def test_a_closed_pipe_ends_quietly(command, code):
    """`batchpilot config schema | head -1`: the reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "batchpilot", *command],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in process.stderr
    assert "error" not in process.stderr.lower()
    assert process.returncode == code


# --- silent acceptances ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "submit"])
def test_a_submit_of_a_local_config_is_refused(tmp_path, dry_run):
    # Port 9 (discard) on loopback: nothing answers there, and nothing may be sent anyway.
    with no_debris(tmp_path):
        outcome = run_cli("submit", "--config", DEMO, "--host", "http://127.0.0.1:9", *dry_run)
    outcome.assert_refused("cluster.backend", "is 'local'", "batchpilot run --local")


# --- a failed `run --local`: its last line, and the folder it leaves --------------------------------------


def test_a_failed_run_ends_with_one_clean_line(tmp_path, local_config, monkeypatch):
    def failing_pipeline(config, *, output, micro_batch_size=0):
        raise RuntimeError(
            "Pipeline \x1b[95m'batchpilot-demo'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m. Inner task "
            "failed: \x1b[96m'train-stage-2'\x1b[0m inside \x1b[96m'exit-handler-1'\x1b[0m."
        )

    monkeypatch.setattr(batchpilot.kfp.local, "run_pipeline", failing_pipeline)
    out = tmp_path / "run"
    outcome = run_cli("run", "--config", local_config, "--out", str(out))
    line = outcome.assert_refused(code=1)
    assert line == (
        "batchpilot: error: the pipeline failed in task 'train-stage-2' inside 'exit-handler-1'; the exit "
        f"handler scaled the pool down; the full log is {out}/pipeline.log; to continue: batchpilot run --config "
        f"{local_config} --out {out} --resume"
    )
    with no_debris(tmp_path):
        again = run_cli("run", "--config", local_config, "--out", str(out))
    again.assert_refused("--out", "is not empty", "pass --resume")


def test_a_run_refused_before_any_task_leaves_no_folder(tmp_path, local_config, monkeypatch):
    def refusing_pipeline(config, *, output, micro_batch_size=0):
        raise BatchpilotError("train.lr", "is wrong", "fix it")

    monkeypatch.setattr(batchpilot.kfp.local, "run_pipeline", refusing_pipeline)
    out = tmp_path / "run"
    run_cli("run", "--config", local_config, "--out", str(out)).assert_refused("train.lr: is wrong")
    assert not out.exists()  # the same command works again once the config is fixed


# --- export --format hf: a checkpoint that is not there, an --out in use, a model with no counterpart -------

LLAMA = (
    "batchpilot.models.llama:build",
    {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "n_embd": 32, "max_seq_len": 32},
)
GPT = ("batchpilot.models.gpt:build", {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32})


def export_run(root: Path, *, model: tuple[str, dict] = LLAMA, steps: tuple[int, ...] = ()) -> str:
    """plan.json of a tiny model under `root` (a manifest without shards for data) and sharded checkpoints of
    `steps`; returns the plan's path."""
    from helpers import tiny_config, write_manifest

    factory, args = model
    config = tiny_config(data_uri=write_manifest(root / "data"), checkpoint_uri=f"file://{root}/ckpt")
    config["model"] = {"factory": factory, "args": {**args, "vocab_size": 257}}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    plan = root / "plan.json"
    assert run_cli("plan", "--config", str(root / "config.yaml"), "--out", str(plan)).code == 0
    save_checkpoints(f"file://{root}/ckpt", model=model, steps=steps)
    return str(plan)


def save_checkpoints(uri: str, *, model: tuple[str, dict], steps: tuple[int, ...]) -> None:
    """Sharded checkpoints of a freshly built model, as the trainer's checkpointer writes them."""
    import torch

    from batchpilot.models.factory import build_model
    from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
    from batchpilot.train.state import training_state

    factory, args = model
    for step in steps:
        built = build_model(factory=factory, args={**args, "vocab_size": 257})
        state = training_state(built, torch.optim.AdamW(built.parameters()))
        Checkpointer(uri=uri).save_sharded(
            step=step, consumed_samples=step * 16, state=state, rng=capture_rng_state()
        )


def export_cli(plan: str, out: Path, *args: str):
    return run_cli("export", "--plan", plan, "--format", "hf", "--out", str(out), *args)


def test_export_of_a_step_with_no_checkpoint_lists_the_steps(tmp_path):
    plan = export_run(tmp_path / "run", steps=(4, 8))
    with no_debris(tmp_path):
        outcome = export_cli(plan, tmp_path / "hf", "--step", "5")
    outcome.assert_refused("--step", "no checkpoint of step 5", "steps there: 4, 8")


def test_export_before_any_checkpoint(tmp_path):
    plan = export_run(tmp_path / "run")
    with no_debris(tmp_path):
        outcome = export_cli(plan, tmp_path / "hf")
    outcome.assert_refused("train.checkpoint_uri", "holds no checkpoint yet", "batchpilot launch")


def test_export_into_a_folder_in_use_without_force(tmp_path):
    plan = export_run(tmp_path / "run", steps=(4,))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with no_debris(tmp_path):
        outcome = export_cli(plan, out)
    outcome.assert_refused("--out", "is not empty", "--force")


def test_export_of_a_model_with_no_hugging_face_counterpart(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text("from batchpilot.models.gpt import build\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = export_run(tmp_path / "run", model=("my_models:build", GPT[1]), steps=(4,))
    with no_debris(tmp_path):
        outcome = export_cli(plan, tmp_path / "hf")
    outcome.assert_refused("model.factory", "my_models:build has no Hugging Face counterpart")


def test_export_without_safetensors_names_the_extra(tmp_path, monkeypatch):
    plan = export_run(tmp_path / "run", steps=(4,))
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # what an import finds when the package is absent
    with no_debris(tmp_path):
        outcome = export_cli(plan, tmp_path / "hf")
    outcome.assert_refused("safetensors", "is not installed", "pip install 'batchpilot[hf]'")


def test_export_of_a_checkpoint_of_another_model(tmp_path):
    plan = export_run(tmp_path / "run", model=GPT)
    save_checkpoints(f"file://{tmp_path}/run/ckpt", model=LLAMA, steps=(4,))  # a Llama's, where the GPT's go
    with no_debris(tmp_path):
        outcome = export_cli(plan, tmp_path / "hf")
    outcome.assert_refused("was written by a different model", "wte.weight")


@pytest.mark.parametrize(
    ("config", "args", "expected"),
    [
        (
            DEMO,
            [],
            "batchpilot: error: cluster.backend: is 'local'; a rehearsal runs on a GKE cluster (fix: rehearse "
            "a gke config (the local pipeline is `batchpilot run`))",
        ),
        (NEMO, ["--pace-s", "0"], "batchpilot: error: --pace-s: must be positive"),
    ],
    ids=["local-config", "zero-pace"],
)
def test_rehearse_refuses_what_cannot_be_rehearsed_in_one_line(config, args, expected, tmp_path):
    """Before any call to the cluster or KFP (the host below answers nothing): one line, exit 2."""
    result = run_cli("rehearse", "--config", config, "--pool", "cheap", "--host", "http://127.0.0.1:9", *args)
    assert result.code == 2 and result.error_lines() == [expected], result
