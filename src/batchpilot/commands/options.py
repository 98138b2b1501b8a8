"""The command line's one vocabulary: option names, their old spellings, and help that shows defaults.

Every command says a thing the same way (docs/cli.md lists them): `--config FILE` for the config, `--out`
for what it writes (a file or a folder, as the command says), `--dry-run` for "show it, do nothing" and
`--force` for "overwrite". The spellings used before (`--output`, `--output-dir`, `--dryrun`, the positional
FILE of `config check`) still parse to the same destination, so scripts keep working, but help, usage and
error messages show only the current name.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
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


class Subcommands(argparse._SubParsersAction):
    """argparse's subcommand action, with the chosen subcommand answering for its own arguments.

    argparse hands an argument the subcommand does not take back to the top-level parser, whose error shows
    `usage: batchpilot [-h] [--version] COMMAND ...`; here the subcommand refuses it with its own usage.
    A subcommand registered without `help` (internal, e.g. `canary-rank`) is not listed in `--help`, nor
    among the choices an unknown command's error offers.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        unrecognized = argparse._UNRECOGNIZED_ARGS_ATTR
        before = len(getattr(namespace, unrecognized, []))
        super().__call__(parser, namespace, values, option_string)
        extras = getattr(namespace, unrecognized, [])[before:]
        if extras:
            chosen = self._name_parser_map[values[0]]
            chosen.error(unrecognized_message(chosen, extras))

    def listed_choices(self) -> list[str]:
        """The subcommands `--help` lists (those registered with a `help`)."""
        return [action.dest for action in self._choices_actions]


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """argparse's `unrecognized arguments: ...`, with the option a mistyped one is closest to."""
    text = f"unrecognized arguments: {' '.join(extras)}"
    shown = [name for action in parser._actions for name in action.option_strings]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], shown, n=1)
            if close:
                return f"{text} (did you mean {close[0]}?)"
    return text


class Parser(argparse.ArgumentParser):
    """The parser of `batchpilot` and, through argparse's `parser_class`, of every subcommand below it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, Subcommands) and value not in action.choices:
            listed = ", ".join(repr(name) for name in action.listed_choices())
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {listed})")
        super()._check_value(action, value)


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
