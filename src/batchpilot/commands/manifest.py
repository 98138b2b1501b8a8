"""A shard set's manifest as a table: what `data prepare`, `data import-megatron` and `data inspect` print."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from batchpilot.data.shards import Manifest


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
