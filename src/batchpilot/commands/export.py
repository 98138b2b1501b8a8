"""`batchpilot export`: a run's checkpoint as a Hugging Face model folder (`--format hf`)."""

from __future__ import annotations

import argparse
from typing import Any

from batchpilot.commands.options import add_out


def register(subparsers: Any) -> None:
    from batchpilot.export import DTYPES, FORMATS

    parser = subparsers.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model folder",
        description="Reads the checkpoint of a run (the one `latest` names, or --step) on this one process, "
        "whatever world size and strategy wrote it, and writes it as a Hugging Face model: config.json, "
        "model.safetensors (or shards and their index), and the shard set's tokenizer.json when the data was "
        "tokenized with one. batchpilot's Llama becomes a LlamaForCausalLM, its GPT a GPT2LMHeadModel. "
        "Needs safetensors: pip install 'batchpilot[hf]'.",
    )
    parser.add_argument(
        "--plan", required=True, metavar="FILE", help="the run document (the run's plan.json)"
    )
    parser.add_argument(
        "--step", type=int, metavar="N", help="the optimizer step of the checkpoint (default: the latest)"
    )
    parser.add_argument("--format", required=True, choices=FORMATS, help="the checkpoint format to write")
    add_out(parser, required=True, metavar="DIR", help="the folder to write (absent or empty, or --force)")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="fp32", help="the weights' type in the files"
    )
    parser.add_argument("--force", action="store_true", help="replace a folder that is not empty")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from batchpilot.export import export_hf

    result = export_hf(plan=args.plan, out=args.out, step=args.step, dtype=args.dtype, force=args.force)
    console = Console()
    table = Table(title=f"{result.out} ({result.architecture})", title_justify="left")
    table.add_column("file")
    table.add_column("bytes", justify="right")
    for name, size in result.files:
        table.add_row(name, f"{size:,}")
    console.print(table)
    total = sum(size for _, size in result.files)
    console.print(
        f"exported step {result.step} ({result.consumed_samples:,} samples): {result.num_params:,} parameters "
        f"({args.dtype}), {total:,} bytes in {len(result.files)} file(s)"
    )
    console.print(result.tokenizer_note)
    return 0
