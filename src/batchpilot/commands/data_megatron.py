"""`batchpilot data import-megatron`: a Megatron-LM .bin/.idx dataset -> a shard set, keeping its token ids."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console

from batchpilot.commands.manifest import print_manifest
from batchpilot.commands.options import add_out
from batchpilot.data.megatron import Vocabulary, import_megatron
from batchpilot.data.tokenizers import HuggingFaceTokenizer
from batchpilot.errors import BatchpilotError
from batchpilot.planning.units import parse_count


def register_import(actions: Any) -> None:
    """Adds `import-megatron` to the `data` subcommands."""
    parser = actions.add_parser(
        "import-megatron",
        help="copy a Megatron-LM .bin/.idx dataset into shards + manifest.json (no re-tokenizing)",
        description="Copies the documents of Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx), in "
        "order, into a shard set at --out with their token ids unchanged. The vocabulary comes from "
        "--vocab-size and --eos-token-id, or from the --tokenizer the data was made with.",
    )
    parser.add_argument(
        "prefixes",
        nargs="+",
        metavar="PREFIX",
        help="dataset path without .bin/.idx: a local path or gs://bucket/path/prefix",
    )
    add_out(
        parser, required=True, metavar="URI", help="the shard set to write: file://path or gs://bucket/prefix"
    )
    parser.add_argument("--vocab-size", type=int, help="number of token ids (with --eos-token-id)")
    parser.add_argument("--eos-token-id", type=int, help="the end-of-document id (with --vocab-size)")
    parser.add_argument(
        "--tokenizer",
        metavar="TOKENIZER_JSON",
        help="the Hugging Face tokenizer.json the data was made with (instead of --vocab-size)",
    )
    parser.add_argument("--eos-token", help="end-of-document token of --tokenizer (default: found by name)")
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document id to each document not already ending with it (default: keep "
        "the tokens exactly as stored)",
    )
    parser.add_argument(
        "--validation-fraction", type=float, default=0.01, help="share of documents held out for validation"
    )
    parser.add_argument("--shard-size-tokens", default="16M", help="tokens per shard, e.g. 1M (default: 16M)")
    parser.add_argument("--force", action="store_true", help="replace an existing shard set at --out")
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    parser.set_defaults(handler=run_import)


def vocabulary_from_args(args: argparse.Namespace) -> Vocabulary:
    """--tokenizer [--eos-token], or --vocab-size with --eos-token-id; never a mix."""
    if args.tokenizer is not None:
        given = [
            flag
            for flag, value in (("--vocab-size", args.vocab_size), ("--eos-token-id", args.eos_token_id))
            if value is not None
        ]
        if given:
            raise BatchpilotError(
                " and ".join(given),
                "conflicts with --tokenizer, which sets the vocabulary",
                "pass one or the other",
            )
        tokenizer = HuggingFaceTokenizer(args.tokenizer, eos_token=args.eos_token)
        return Vocabulary(
            vocab_size=tokenizer.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
            describe={key: value for key, value in tokenizer.describe().items() if key != "kind"},
            tokenizer_json=tokenizer.file_bytes(),
        )
    if args.eos_token is not None:
        raise BatchpilotError("--eos-token", "only applies with --tokenizer", "pass --eos-token-id instead")
    if args.vocab_size is None or args.eos_token_id is None:
        missing = "--vocab-size" if args.vocab_size is None else "--eos-token-id"
        raise BatchpilotError(
            missing,
            "is needed: the token ids' vocabulary is not stored in a Megatron-LM dataset",
            "pass --vocab-size N --eos-token-id M, or --tokenizer tokenizer.json",
        )
    if args.vocab_size < 1:
        raise BatchpilotError("--vocab-size", f"must be at least 1, got {args.vocab_size}")
    return Vocabulary(vocab_size=args.vocab_size, eos_token_id=args.eos_token_id, describe={})


def run_import(args: argparse.Namespace) -> int:

    vocabulary = vocabulary_from_args(args)
    started = time.perf_counter()
    result = import_megatron(
        prefixes=args.prefixes,
        out_uri=args.out,
        vocabulary=vocabulary,
        shard_size_tokens=parse_count(args.shard_size_tokens, field="--shard-size-tokens"),
        validation_fraction=args.validation_fraction,
        append_eod=args.append_eod,
        force=args.force,
        show_progress=not args.no_progress,
    )
    ending, eos = result.num_documents_ending_with_eos, vocabulary.eos_token_id
    if args.append_eod:
        eod = f"end-of-document id {eos} appended to {result.num_documents - ending:,}, {ending:,} ended with it"
    else:
        eod = (
            f"{ending:,} of {result.num_documents:,} end with end-of-document id {eos}; tokens kept as stored"
        )
        if ending < result.num_documents:
            eod += " (--append-eod adds it to the others)"
    console = Console()
    console.print(
        f"imported {result.num_documents:,} document(s), {result.num_tokens:,} tokens from "
        f"{len(args.prefixes)} dataset(s) in {time.perf_counter() - started:.1f} s ({eod})"
    )
    print_manifest(result.manifest, uri=args.out, console=console)
    return 0
