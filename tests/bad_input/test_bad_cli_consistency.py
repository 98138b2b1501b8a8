"""The command line does what docs/cli.md says: one vocabulary (`--force`, `--dry-run`, `--stage`, plain paths)
taken by every command it names, argparse's errors under the usage of the command given, internal commands
kept out of sight, the old-spellings table true to the parser, and messages that name the field and the fix
instead of a Python tuple, a class name, `version None` or "delete the file". Every refusal has a valid twin
that passes, so no check is vacuous."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from harness import closed_port, no_debris, run_cli, run_process

import batchpilot.commands.explore
import batchpilot.commands.run
import batchpilot.kfp.local
import batchpilot.workflow.explore
from batchpilot.cli import build_parser
from batchpilot.commands.reference import subcommands
from helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DEMO = str(CONFIGS / "demo.yaml")
NEMO = str(CONFIGS / "nemo_gpt3_5b.yaml")


def prepare_shards(folder: Path, *, lines: int = 2000) -> Path:
    """A small real byte-level shard set at `folder` (no validation split); returns the folder."""
    text = folder.parent / f"{folder.name}.txt"
    text.write_text("a few words to tokenize\n" * lines)
    prepared = run_cli(
        "data",
        "prepare",
        str(text),
        "--out",
        f"file://{folder}",
        "--validation-fraction",
        "0",
        "--no-progress",
    )
    assert prepared.code == 0, prepared.stderr
    return folder


@pytest.fixture
def local_config(tmp_path: Path) -> str:
    """The demo config on a small real shard set, as `batchpilot run` needs it."""
    data = prepare_shards(tmp_path / "data")
    config = yaml.safe_load(Path(DEMO).read_text())
    config["data"]["uri"] = f"file://{data}"
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


# --- 1. run --force: start a previous run over, never empty a folder that is not a run's -------------------


def previous_run(folder: Path) -> Path:
    """A run folder as a failed `batchpilot run` leaves it: its pipeline.log, metrics and a checkpoint."""
    (folder / "ckpt" / "000000004").mkdir(parents=True)
    (folder / "ckpt" / "000000004" / "model.pt").write_text("old weights")
    (folder / batchpilot.kfp.local.LOG_NAME).write_text("old log\n")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


@pytest.fixture
def stub_pipeline(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """`run_pipeline` replaced by one that records what --out holds when the pipeline would start."""
    seen: list[list[str]] = []

    def pipeline(config: object, *, output: Path, micro_batch_size: int = 0) -> None:
        seen.append(sorted(str(path.relative_to(output)) for path in output.rglob("*")))

    monkeypatch.setattr(batchpilot.kfp.local, "run_pipeline", pipeline)
    monkeypatch.setattr(batchpilot.commands.run, "_summary", lambda *args, **kwargs: None)
    return seen


def test_run_force_refuses_a_folder_that_holds_no_run(tmp_path, local_config, stub_pipeline):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own notes")
    with no_debris(tmp_path):
        outcome = run_cli("run", "--config", local_config, "--out", str(mine), "--force")
    outcome.assert_refused("--out", "holds no batchpilot run", "pipeline.log", "fix:")
    assert stub_pipeline == []
    # Twin: a previous run's folder is emptied and the run starts over in it.
    run = previous_run(tmp_path / "run")
    started = run_cli("run", "--config", local_config, "--out", str(run), "--force")
    assert started.code == 0, started.stderr
    assert stub_pipeline == [["pipeline.log"]]  # the old checkpoint and metrics went, a new log began
    assert "old log" not in (run / "pipeline.log").read_text()


def test_run_force_with_resume_is_refused(tmp_path, local_config, stub_pipeline):
    run = previous_run(tmp_path / "run")
    with no_debris(tmp_path):
        outcome = run_cli("run", "--config", local_config, "--out", str(run), "--force", "--resume")
    outcome.assert_refused("--force", "--resume", "fix: leave out one of them")
    assert stub_pipeline == []
    # Twin: --resume alone continues the run, keeping what it holds.
    resumed = run_cli("run", "--config", local_config, "--out", str(run), "--resume")
    assert resumed.code == 0, resumed.stderr
    assert "ckpt/000000004/model.pt" in stub_pipeline[0]


# --- 2. explore: an earlier exploration is not overwritten without --force ---------------------------------


@pytest.fixture
def stub_explore(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The exploration replaced by one that writes explore.json as it would (no probe runs)."""
    calls: list[Path] = []

    def explore(config: object, *, output_dir: Path, **kwargs: object) -> SimpleNamespace:
        calls.append(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "explore.json").write_text('{"new": true}\n')
        return SimpleNamespace(output_dir=output_dir)

    monkeypatch.setattr(batchpilot.workflow.explore, "explore", explore)
    monkeypatch.setattr(batchpilot.commands.explore, "_summary", lambda result: None)
    return calls


def test_explore_refuses_an_out_that_holds_explore_json_without_force(tmp_path, stub_explore):
    out = tmp_path / "explore"
    out.mkdir()
    (out / "explore.json").write_text('{"old": true}\n')
    with no_debris(tmp_path):
        outcome = run_cli("explore", "--config", DEMO, "--out", str(out))
    outcome.assert_refused("--out", "already holds explore.json", "--force")
    assert stub_explore == []  # refused before any probe
    # Twins: a new folder, and the used one with --force.
    assert run_cli("explore", "--config", DEMO, "--out", str(tmp_path / "new")).code == 0
    assert run_cli("explore", "--config", DEMO, "--out", str(out), "--force").code == 0
    assert stub_explore == [tmp_path / "new", out]
    assert json.loads((out / "explore.json").read_text()) == {"new": True}


# --- 3. compile --dry-run: compile, say what would be written, write nothing --------------------------------


def test_compile_dry_run_prints_what_it_would_write_and_writes_nothing(tmp_path):
    out = tmp_path / "pipelines" / "nemo.yaml"
    with no_debris(tmp_path):
        outcome = run_cli("compile", "--config", NEMO, "--out", str(out), "--dry-run")
    assert outcome.code == 0, outcome.stderr
    (line,) = outcome.stdout.splitlines()
    assert line.startswith(f"would write {out} (")
    assert "pipeline batchpilot-gpt3-5b" in line
    assert "8 stage(s) in launch group(s) stages-0-3, stage-4, stage-5, stage-6, final" in line
    assert re.search(r", \d+ task\(s\), ", line), line
    assert line.endswith("nothing written (--dry-run)")
    # Twin: without --dry-run the same command writes the file.
    assert run_cli("compile", "--config", NEMO, "--out", str(out)).code == 0
    assert out.read_text().startswith("# PIPELINE DEFINITION")


def test_compile_dry_run_refuses_what_compile_refuses(tmp_path):
    existing = tmp_path / "pipeline.yaml"
    existing.write_text("mine\n")
    with no_debris(tmp_path):
        outcome = run_cli("compile", "--config", NEMO, "--out", str(existing), "--dry-run")
    outcome.assert_refused("--out", "exists", "--force")
    # Twin: with --force it is shown, still not written.
    with no_debris(tmp_path):
        shown = run_cli("compile", "--config", NEMO, "--out", str(existing), "--dry-run", "--force")
    assert shown.code == 0, shown.stderr
    assert shown.stdout.startswith(f"would write {existing}")


# --- 4. data inspect: a plain folder path is the file:// URI of it ------------------------------------------


def test_data_inspect_takes_a_plain_folder_path(tmp_path, monkeypatch):
    shards = prepare_shards(tmp_path / "shards", lines=200)
    monkeypatch.chdir(tmp_path)
    by_uri = run_cli("data", "inspect", f"file://{shards}")
    assert by_uri.code == 0, by_uri.stderr
    for plain in (str(shards), "shards"):  # absolute and relative
        with no_debris(tmp_path):
            outcome = run_cli("data", "inspect", plain)
        assert outcome.code == 0, outcome.stderr
        assert outcome.stdout == by_uri.stdout
    # Twin: a plain path with no shard set is refused for that, not for being a plain path.
    with no_debris(tmp_path):
        missing = run_cli("data", "inspect", str(tmp_path / "nothing"))
    missing.assert_refused(
        f"file://{tmp_path}/nothing/manifest.json", "does not exist", "batchpilot data prepare"
    )


# --- 5. --stage takes the plan's names ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def nemo_plan(tmp_path_factory: pytest.TempPathFactory) -> str:
    """plan.json of the NeMo GPT-3 5B example: launches stages-0-3, stage-4, stage-5, stage-6, final."""
    path = tmp_path_factory.mktemp("nemo") / "plan.json"
    planned = run_cli("plan", "--config", NEMO, "--out", str(path))
    assert planned.code == 0, planned.stderr
    return str(path)


def test_launch_takes_the_plans_stage_and_launch_names(nemo_plan, tmp_path):
    # stage-1 lies inside the launch stages-0-3: before, only the names of whole launches were taken.
    for stage, job in [
        ("stage-1", "gpt3-5b-stage-1-"),
        ("stage-4", "gpt3-5b-stage-4-"),
        ("stages-0-3", "gpt3-5b-stages-0-3-"),
        ("final", "gpt3-5b-final-"),
    ]:
        with no_debris(tmp_path):
            outcome = run_cli("launch", "--plan", nemo_plan, "--stage", stage, "--dry-run")
        assert outcome.code == 0, (stage, outcome.stderr)
        assert f"name: {job}" in outcome.stdout
    # Twin refusal: a name that is no stage of this plan.
    with no_debris(tmp_path):
        refused = run_cli("launch", "--plan", nemo_plan, "--stage", "stage-9", "--dry-run")
    refused.assert_refused("--stage", "'stage-9' is not a stage of this plan")  # as typed, not '9'


def test_train_takes_the_plans_stage_names(tmp_path):
    data = prepare_shards(tmp_path / "data")
    config = tiny_config(
        data_uri=f"file://{data}", checkpoint_uri=f"file://{tmp_path}/ckpt", train__eval_samples=0
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    plan = tmp_path / "plan.json"
    assert run_cli("plan", "--config", str(tmp_path / "config.yaml"), "--out", str(plan)).code == 0
    with no_debris(tmp_path):
        refused = run_process(
            "train", "--plan", str(plan), "--stage", "stage-9", "--out", str(tmp_path / "out")
        )
    refused.assert_refused("--stage", "'stage-9' is not a stage of this plan")
    # Twin: `stage-0`, as `batchpilot plan` names the first stage, trains it.
    trained = run_process("train", "--plan", str(plan), "--stage", "stage-0", "--out", str(tmp_path / "out"))
    assert trained.code == 0, trained.stderr[-2000:]
    assert "stage-0 done" in trained.stdout + trained.stderr


# --- 6. a subcommand's argparse error shows that subcommand's usage -----------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_shards(tmp_path_factory.mktemp("inspect") / "shards", lines=200)


@pytest.mark.parametrize(
    ("argv", "mistake", "line"),
    [
        (["plan", "--config", NEMO], ["--confg", "x.yaml"],
         "batchpilot plan: error: unrecognized arguments: --confg x.yaml (did you mean --config?)"),
        (["data", "inspect", "SHARDS"], ["--bogus"], "batchpilot data inspect: error: unrecognized arguments: --bogus"),
    ],
    ids=["plan", "data inspect"],
)  # fmt: skip
def test_a_mistyped_flag_shows_the_subcommands_usage(tmp_path, shards, argv, mistake, line):
    argv = [f"file://{shards}" if arg == "SHARDS" else arg for arg in argv]
    with no_debris(tmp_path, shards):
        outcome = run_cli(*argv, *mistake)
    assert outcome.assert_refused() == line
    assert outcome.stderr.startswith(f"usage: batchpilot {' '.join(argv[: 2 if argv[0] == 'data' else 1])} ")
    assert "usage: batchpilot [-h]" not in outcome.stderr
    # Twin: the same command without the mistake runs.
    with no_debris(tmp_path):
        spelled_right = run_cli(*argv)
    assert spelled_right.code == 0, spelled_right.stderr


# --- 7. internal commands stay out of sight ---------------------------------------------------------------


def test_an_unknown_command_lists_the_public_commands_only(tmp_path):
    with no_debris(tmp_path):
        outcome = run_cli("nosuchcommand")
    line = outcome.assert_refused("invalid choice: 'nosuchcommand'", "'plan'", "'rehearse'")
    assert "canary-rank" not in line
    helped = run_cli("--help")
    assert helped.code == 0 and "rehearse" in helped.stdout and "canary-rank" not in helped.stdout
    # Twin: the internal command is still taken by the pipeline that starts it.
    internal = run_cli("canary-rank", "--help")
    assert internal.code == 0 and internal.stdout.startswith("usage: batchpilot canary-rank")


# --- 8. the old-spellings table of docs/cli.md says what the parser takes ----------------------------------


def test_the_old_spellings_table_names_every_command_that_takes_each():
    document = (REPO / "docs" / "cli.md").read_text()
    table = document.split("### Old spellings", 1)[1].split("\n\n")[2]
    documented: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        old = row.split("|")[1]
        options = re.findall(r"`(--[a-z-]+)`", old.split("(")[0])
        commands = set(re.findall(r"`([a-z][a-z -]*)`", old.split("(", 1)[1])) if "(" in old else set()
        for option in options:
            documented[option] = commands
    taken: dict[str, set[str]] = {}
    for path, parser in subcommands(build_parser()):
        for option, action in parser._option_string_actions.items():
            if option not in action.option_strings:  # an alias: taken, not shown
                taken.setdefault(option, set()).add(" ".join(path))
    assert taken.keys() == {"--output", "--output-dir", "--dryrun"}
    assert documented == taken


# --- 9. messages that name the field and the fix -----------------------------------------------------------


def test_a_json_file_that_is_no_key_is_named_without_a_python_tuple(no_google_credentials, monkeypatch):
    from test_bad_data import dummy_service_account

    folder = no_google_credentials
    not_a_key = folder / "settings.json"
    not_a_key.write_text('{"theme": "dark"}')
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(not_a_key))
    with no_debris(folder):
        line = run_cli("data", "inspect", "gs://bp-bucket/set").assert_refused(
            f"GOOGLE_APPLICATION_CREDENTIALS ({not_a_key})", 'not a service-account key (it has no "type"',
            "fix: point GOOGLE_APPLICATION_CREDENTIALS at a service-account key file",
        )  # fmt: skip
    assert "('" not in line and "Type is None" not in line
    incomplete = folder / "incomplete.json"
    incomplete.write_text('{"type": "service_account", "client_email": "x@y"}')
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(incomplete))
    with no_debris(folder):
        line = run_cli("data", "inspect", "gs://bp-bucket/set").assert_refused(
            f"from {incomplete}: Service account info was not in the expected format, missing fields token_uri",
            "fix: point GOOGLE_APPLICATION_CREDENTIALS",
        )
    assert "('" not in line and "Error(" not in line
    # Twin: a well-formed key passes the key-file check and is refused only for its token endpoint.
    key = dummy_service_account(folder / "key.json", token_uri=f"http://127.0.0.1:{closed_port()}/token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    run_cli("data", "inspect", "gs://bp-bucket/set").assert_refused(
        "got no access token", "Connection refused"
    )


def nemo_with_rampup(folder: Path, rampup: object) -> str:
    config = yaml.safe_load(Path(NEMO).read_text())
    config["batch"]["rampup"] = rampup
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    ("rampup", "where", "expected", "hidden"),
    [
        (16, "batch.rampup", "must be a list [start, increment, samples] or a mapping", "MegatronRampup"),
        ({"adaptive": [1, 2]}, "batch.rampup.adaptive", "must be a mapping of its keys (start, samples,",
         "AdaptiveSettings"),
    ],
    ids=["number", "adaptive-list"],
)  # fmt: skip
def test_a_ramp_of_the_wrong_shape_is_named_without_a_class_name(tmp_path, rampup, where, expected, hidden):
    config = nemo_with_rampup(tmp_path, rampup)
    with no_debris(tmp_path):
        line = run_cli("config", "check", "--config", config).assert_refused(f"{where}: {expected}", "(fix: ")
    assert hidden not in line and "instance of" not in line
    # Twin: the list form the message shows is taken.
    fixed = run_cli("config", "check", "--config", nemo_with_rampup(tmp_path, [256, 256, 10_000_000]))
    assert fixed.code == 0, fixed.stderr


def test_a_manifest_that_is_not_batchpilots_is_named_without_version_none(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    with no_debris(tmp_path):
        line = run_cli("data", "inspect", f"file://{junk}").assert_refused(
            f"file://{junk}/manifest.json: is JSON but not a batchpilot manifest",
            f"fix: point at the folder `batchpilot data prepare --out` wrote, or prepare the shard set again: "
            f"batchpilot data prepare ... --out file://{junk}",
        )
    assert "None" not in line
    # Twin: a shard set batchpilot prepared is read.
    shards = prepare_shards(tmp_path / "shards", lines=200)
    assert run_cli("data", "inspect", f"file://{shards}").code == 0


@pytest.mark.parametrize("action", [["status"], ["resize", "--nodes", "1"], ["scale-down"]])
def test_a_pool_state_that_batchpilot_did_not_write_is_never_to_be_deleted(tmp_path, action):
    notes = tmp_path / "notes.txt"
    notes.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with no_debris(tmp_path):
        line = run_cli("pool", *action, "--config", DEMO, "--pool-state", str(notes)).assert_refused(
            f"--pool-state: cannot read the local pool state {notes}: it is not a pool state file",
            "fix: point --pool-state at a pool state file batchpilot wrote, or at a new path",
        )
    assert "delete" not in line
    # Twin: a new path starts as an empty pool, and the file batchpilot writes there is read back.
    state = tmp_path / "pool.json"
    assert run_cli("pool", "resize", "--nodes", "1", "--config", DEMO, "--pool-state", str(state)).code == 0
    outcome = run_cli("pool", *action, "--config", DEMO, "--pool-state", str(state))
    assert outcome.code == 0, outcome.stderr
