"""`batchpilot data prepare|inspect`: text -> token shards at a file:// or gs:// URI, and their summary."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from batchpilot.commands.options import add_out
from batchpilot.data.prepare import collect_inputs, demo_inputs, prepare
from batchpilot.data.shards import Manifest, read_manifest
from batchpilot.data.storage import open_storage
from batchpilot.data.tokenizers import load_tokenizer
from batchpilot.errors import BatchpilotError
from batchpilot.planning.units import parse_count


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "data",
        help="prepare and inspect token shard sets",
        description="Token shards in a local folder or GCS.",
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenize text files into shards + manifest.json",
        description="Tokenizes text files (each file is one document) into shards at --out, writing "
        "manifest.json last. The default tokenizer is byte-level (vocabulary 257).",
    )
    prep.add_argument(
        "inputs", nargs="*", metavar="INPUT", help="text files or folders (searched with --glob)"
    )
    add_out(
        prep, required=True, metavar="URI", help="the shard set to write: file://path or gs://bucket/prefix"
    )
    prep.add_argument(
        "--demo", action="store_true", help="use the Python standard library's .py files as input"
    )
    prep.add_argument("--glob", default="*.txt", help="file pattern inside INPUT folders (default: *.txt)")
    prep.add_argument("--shard-size-tokens", default="16M", help="tokens per shard, e.g. 1M (default: 16M)")
    prep.add_argument(
        "--validation-fraction", type=float, default=0.01, help="share of documents held out for validation"
    )
    prep.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json")
    prep.add_argument("--eos-token", help="end-of-document token of --tokenizer (default: found by name)")
    prep.add_argument("--force", action="store_true", help="replace an existing shard set at --out")
    prep.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    prep.set_defaults(handler=run_prepare)
    inspect = actions.add_parser(
        "inspect",
        help="print the manifest summary of a shard set",
        description="Reads manifest.json of a shard set and prints its splits, shards, tokens, bytes and tokenizer.",
    )
    inspect.add_argument("uri", help="file://path or gs://bucket/prefix")
    inspect.set_defaults(handler=run_inspect)
    from batchpilot.commands.data_megatron import register_import  # its own module: Megatron-LM datasets

    register_import(actions)


def run_prepare(args: argparse.Namespace) -> int:
    if args.demo == bool(args.inputs):
        raise BatchpilotError("INPUT", "give input files or folders, or --demo (not both)")
    files = demo_inputs() if args.demo else collect_inputs(args.inputs, glob=args.glob)
    tokenizer = load_tokenizer(args.tokenizer, eos_token=args.eos_token)
    started = time.perf_counter()
    manifest = prepare(
        inputs=files,
        out_uri=args.out,
        tokenizer=tokenizer,
        shard_size_tokens=parse_count(args.shard_size_tokens, field="--shard-size-tokens"),
        validation_fraction=args.validation_fraction,
        force=args.force,
        show_progress=not args.no_progress,
    )
    console = Console()
    console.print(f"prepared {len(files)} file(s) in {time.perf_counter() - started:.1f} s")
    print_manifest(manifest, uri=args.out, console=console)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    print_manifest(read_manifest(open_storage(args.uri)), uri=args.uri, console=Console())
    return 0


def print_manifest(manifest: Manifest, *, uri: str, console: Console) -> None:
    """Splits, shards, tokens and bytes of a shard set, with its tokenizer."""
    table = Table(title=f"shard set {uri}", title_justify="left")
    for column in ("split", "shards", "tokens", "bytes"):
        table.add_column(column, justify="left" if column == "split" else "right")
    for split, shards in manifest.splits.items():
        table.add_row(
            split,
            str(len(shards)),
            f"{manifest.num_tokens(split):,}",
            f"{sum(s.num_bytes for s in shards):,}",
        )
    console.print(table)
    tokenizer = ", ".join(f"{key}={value}" for key, value in manifest.tokenizer.items())
    console.print(
        f"tokenizer {tokenizer}; vocab_size {manifest.vocab_size}; eos_token_id {manifest.eos_token_id}; "
        f"dtype {manifest.dtype}"
    )
