"""The command line's one vocabulary: option names, their old spellings, and help that shows defaults.

Every command says a thing the same way (docs/cli.md lists them): `--config FILE` for the config, `--out`
for what it writes (a file or a folder, as the command says), `--dry-run` for "show it, do nothing" and
`--force` for "overwrite". The spellings used before (`--output`, `--output-dir`, `--dryrun`, the positional
FILE of `config check`) still parse to the same destination, so scripts keep working, but help, usage and
error messages show only the current name.
"""

from __future__ import annotations

import argparse
from typing import Any

OUT_ALIASES = ("--output", "--output-dir")
"""Old spellings of `--out`: `run` and `compile` said `--output`; `explore`, `train` and `launch` said
`--output-dir`."""
DRY_RUN_ALIASES = ("--dryrun",)
"""Old spelling of `--dry-run`: `launch` said `--dryrun`."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with `(default: X)` after every option whose default says something.

    An option without a default (None), a flag (False) or a help text that already names its default is left
    as written.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or text == argparse.SUPPRESS or "default" in text:
            return text
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default == []:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The parser of `batchpilot` and, through argparse's `parser_class`, of every subcommand below it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_option(
    parser: argparse.ArgumentParser, name: str, *, aliases: tuple[str, ...] = (), **kwargs: Any
) -> argparse.Action:
    """Adds option `name` that `aliases` also set (same action, same destination), showing `name` alone.

    argparse finds an option through the parser's table of option strings, which keeps every alias; the
    action's own `option_strings` is only what help, usage and error messages print.
    """
    action = parser.add_argument(name, *aliases, **kwargs)
    action.option_strings = [name]
    return action


def add_config(parser: argparse.ArgumentParser, *, help: str = "YAML config file") -> argparse.Action:
    """The required `--config FILE` of every command that reads a config."""
    return parser.add_argument("--config", required=True, metavar="FILE", help=help)


def add_out(parser: argparse.ArgumentParser, *, help: str, **kwargs: Any) -> argparse.Action:
    """`--out`: the file or folder a command writes (old spellings `--output`, `--output-dir`)."""
    return add_option(parser, "--out", aliases=OUT_ALIASES, help=help, **kwargs)


def add_dry_run(parser: argparse.ArgumentParser, *, help: str) -> argparse.Action:
    """`--dry-run`: show what would be done and do nothing (old spelling `--dryrun`)."""
    return add_option(parser, "--dry-run", aliases=DRY_RUN_ALIASES, action="store_true", help=help)
