"""`batchpilot data prepare|inspect`: text -> token shards at a file:// or gs:// URI, and their summary."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from batchpilot.commands.data_megatron import register_import  # its own module: Megatron-LM datasets
from batchpilot.commands.manifest import print_manifest
from batchpilot.commands.options import add_out
from batchpilot.data.corpora import FORMATS, collect_sources, text_sources
from batchpilot.data.prepare import PrepareInterrupted, PrepareStats, demo_inputs, prepare
from batchpilot.data.shards import read_manifest
from batchpilot.data.tokenizers import load_tokenizer, usable_cores
from batchpilot.errors import BatchpilotError
from batchpilot.planning.units import parse_count
from batchpilot.storage import open_storage


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "data",
        help="prepare and inspect token shard sets",
        description="Token shards in a local folder or GCS.",
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenize a corpus into shards + manifest.json",
        description="Tokenizes a corpus into shards at --out on every core, writing manifest.json last: "
        "text files (each file is one document), JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst), Parquet, "
        "or a `datasets` save_to_disk folder, local or gs://. The default tokenizer is byte-level "
        "(vocabulary 257). A run stopped part-way (Ctrl-C, preemption, a bad file) keeps the shards it "
        "finished: the same command resumes it, to the same bytes.",
    )
    prep.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="files, folders (searched recursively) or gs://bucket/prefix; format by suffix",
    )
    add_out(
        prep, required=True, metavar="URI", help="the shard set to write: file://path or gs://bucket/prefix"
    )
    prep.add_argument(
        "--demo", action="store_true", help="use the Python standard library's .py files as input"
    )
    prep.add_argument("--glob", default="*.txt", help="text files inside INPUT folders (default: *.txt)")
    prep.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="input format (default: auto, by suffix: .jsonl[.gz|.zst], .parquet, a folder with "
        "state.json; other named files are text)",
    )
    prep.add_argument(
        "--text-field",
        default="text",
        help="the JSON field or column holding the text (default: text)",
    )
    prep.add_argument(
        "--workers",
        type=int,
        help="tokenizer processes (default: every usable core; the shards are the same for any count)",
    )
    prep.add_argument("--shard-size-tokens", default="16M", help="tokens per shard, e.g. 1M (default: 16M)")
    prep.add_argument(
        "--validation-fraction", type=float, default=0.01, help="share of documents held out for validation"
    )
    prep.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json")
    prep.add_argument("--eos-token", help="end-of-document token of --tokenizer (default: found by name)")
    prep.add_argument(
        "--force",
        action="store_true",
        help="replace an existing shard set at --out, or start over instead of resuming an interrupted prepare",
    )
    prep.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    prep.set_defaults(handler=run_prepare)
    inspect = actions.add_parser(
        "inspect",
        help="print the manifest summary of a shard set",
        description="Reads manifest.json of a shard set and prints its splits, shards, tokens, bytes and tokenizer.",
    )
    inspect.add_argument("uri", help="file://path, gs://bucket/prefix or a local folder")
    inspect.set_defaults(handler=run_inspect)

    register_import(actions)


def run_prepare(args: argparse.Namespace) -> int:
    if args.demo == bool(args.inputs):
        raise BatchpilotError("INPUT", "give input files or folders, or --demo (not both)")
    sources = (
        text_sources(demo_inputs())
        if args.demo
        else collect_sources(args.inputs, glob=args.glob, fmt=args.format)
    )
    tokenizer = load_tokenizer(args.tokenizer, eos_token=args.eos_token)
    stats: list[PrepareStats] = []
    try:
        manifest = prepare(
            inputs=sources,
            out_uri=args.out,
            tokenizer=tokenizer,
            shard_size_tokens=parse_count(args.shard_size_tokens, field="--shard-size-tokens"),
            validation_fraction=args.validation_fraction,
            text_field=args.text_field,
            workers=usable_cores() if args.workers is None else args.workers,
            force=args.force,
            show_progress=not args.no_progress,
            stats=stats,
        )
    except PrepareInterrupted as stopped:
        # One line that says what is kept and how to go on; the exit code a signal's death would give.
        what = "interrupted" if stopped.signal_name == "SIGINT" else f"terminated ({stopped.signal_name})"
        print(f"batchpilot: {what}" + (f": {stopped.kept}" if stopped.kept else ""), file=sys.stderr)
        return 128 + int(getattr(signal, stopped.signal_name))
    console = Console()
    (done,) = stats
    console.print(
        f"prepared {done.num_documents:,} document(s) from {len(sources)} input object(s) in "
        f"{done.seconds:.1f} s ({done.num_tokens / max(done.seconds, 1e-9):,.0f} tokens/s)"
    )
    print_manifest(manifest, uri=args.out, console=console)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    uri = args.uri if "://" in args.uri else f"file://{Path(args.uri).absolute()}"  # a plain local path
    print_manifest(read_manifest(open_storage(uri)), uri=uri, console=Console())
    return 0
