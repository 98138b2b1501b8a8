"""Issue #24: one name per concept on the command line (docs/cli.md), the old spellings still taken.

Every subcommand explains itself (`--help` has a description); help shows defaults and the current names
only; `--output`, `--output-dir`, `--dryrun` and `config check FILE` parse as before.
"""

from pathlib import Path

import pytest

from batchpilot.cli import build_parser, main
from batchpilot.commands.options import Parser, add_option
from batchpilot.commands.reference import subcommands, with_reference

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
NEMO = str(CONFIGS / "nemo_gpt3_5b.yaml")


def test_every_subcommand_has_a_description():
    found = dict(subcommands(build_parser()))
    assert {"launch", "config check", "data inspect", "pool status"} <= {" ".join(p) for p in found}
    missing = [" ".join(path) for path, parser in found.items() if not (parser.description or "").strip()]
    assert missing == []


@pytest.mark.parametrize(
    ("old", "new", "dest"),
    [
        (["compile", "--config", "c.yaml", "--output", "x"], ["compile", "--config", "c.yaml", "--out", "x"], "out"),
        (["run", "--output", "x"], ["run", "--out", "x"], "out"),
        (["explore", "--config", "c.yaml", "--output-dir", "x"], ["explore", "--config", "c.yaml", "--out", "x"], "out"),
        (["train", "--plan", "p", "--stage", "0", "--output-dir", "x"], ["train", "--plan", "p", "--stage", "0", "--out", "x"], "out"),
        (["launch", "--plan", "p", "--stage", "0", "--output-dir", "x"], ["launch", "--plan", "p", "--stage", "0", "--out", "x"], "out"),
        (["launch", "--plan", "p", "--stage", "0", "--dryrun"], ["launch", "--plan", "p", "--stage", "0", "--dry-run"], "dry_run"),
        (["data", "prepare", "--demo", "--output", "file://x"], ["data", "prepare", "--demo", "--out", "file://x"], "out"),
    ],
)  # fmt: skip
def test_an_old_spelling_sets_what_the_new_name_sets(old, new, dest):
    parser = build_parser()
    by_old, by_new = parser.parse_args(old), parser.parse_args(new)
    assert getattr(by_new, dest) not in (None, False)  # the new name sets it...
    assert getattr(by_old, dest) == getattr(by_new, dest)  # ...and so does the old one


def test_config_check_takes_the_config_either_way(capsys):
    assert main(["config", "check", "--config", NEMO]) == 0
    by_option = capsys.readouterr().out
    assert main(["config", "check", NEMO]) == 0
    assert capsys.readouterr().out == by_option
    assert by_option.startswith(f"{NEMO}: ok (name=gpt3-5b")


def test_config_check_without_a_config_is_one_line(capsys):
    assert main(["config", "check"]) == 2
    assert capsys.readouterr().err == (
        "batchpilot: error: --config: is required (fix: batchpilot config check --config FILE)\n"
    )


@pytest.mark.parametrize(
    ("command", "shown", "hidden"),
    [
        (["launch"], "--dry-run", "--dryrun"),
        (["launch"], "--out DIR", "--output-dir"),
        (["explore"], "--out DIR", "--output-dir"),
        (["compile"], "--out FILE", "--output"),
        (["run"], "--out DIR", "--output"),
    ],
)
def test_help_shows_the_current_name_only(command, shown, hidden, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert shown in text
    assert hidden not in text


def test_an_error_names_the_current_option_only(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--config", NEMO])
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "batchpilot compile: error: the following arguments are required: --out"


def test_help_shows_defaults_that_say_something():
    parser = Parser(prog="p")  # every batchpilot parser's formatter: HelpFormatter
    parser.add_argument("--size", type=int, default=16, help="micro batch")
    parser.add_argument("--glob", default="*.txt", help="pattern (default: every text file)")
    parser.add_argument("--force", action="store_true", help="overwrite")
    parser.add_argument("--name", help="a name")
    text = " ".join(parser.format_help().split())
    assert "--size SIZE micro batch (default: 16)" in text
    assert "pattern (default: every text file) " in text  # said once, in the help's own words
    assert "--force overwrite " in text
    assert text.endswith("--name NAME a name")


def test_a_subcommand_shows_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--help"])
    assert "(default: 0.01)" in " ".join(capsys.readouterr().out.split())


def test_an_alias_is_taken_but_never_shown():
    parser = Parser(prog="p")
    add_option(parser, "--new", aliases=("--old",), required=True, help="h")
    assert parser.parse_args(["--old", "v"]).new == "v"
    assert "--old" not in parser.format_help()
    assert "--old" not in parser.format_usage()


def test_run_needs_no_local_flag(tmp_path):
    """`--local` is what `run` always does: leaving it out reaches the config's own checks."""
    args = build_parser().parse_args(["run", "--out", str(tmp_path / "r")])
    assert args.local is False
    config = tmp_path / "gke.yaml"
    config.write_text(Path(NEMO).read_text())
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()


def test_docs_cli_md_lists_what_the_parser_takes():
    """docs/cli.md's reference is the parser's; rewrite it with `python -m batchpilot.commands.reference
    docs/cli.md` after changing an option."""
    document = (REPO / "docs" / "cli.md").read_text()
    assert with_reference(document, build_parser()) == document
    assert (
        "| `--out DIR` |  | the folder the outputs go to (default: runs/&lt;name&gt;/explore) | `--output`, `--output-dir` |"
        in document
    )
    # an internal command (registered without a help, run only by a pipeline task) is not documented, as
    # --help does not list it; a listed one is
    assert "### `batchpilot canary-rank`" not in document and "### `batchpilot export`" in document
