"""Subcommands of the `batchpilot` command line (see batchpilot.cli.COMMAND_MODULES)."""
