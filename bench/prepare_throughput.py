"""`data prepare` tokenizing throughput against the `tokenizers` library alone, and its scaling with workers.

The corpus: the Python standard library's `.py` files (real text, no download) cut at line boundaries into
documents of about 4 KB, cycled until `--corpus-mb`, written as one JSON Lines file. The tokenizer: a
byte-level BPE tokenizer.json (vocabulary `--vocab-size`) trained on the first 4 MB with the `tokenizers`
library in this run.

Rows:
- baseline: `Tokenizer.encode_batch` on the same texts in the same batches, one thread
  (TOKENIZERS_PARALLELISM=false), in this process; the ids only counted. Also `encode_batch_fast` (the
  same ids without character offsets), which prepare calls.
- prepare --workers 1: `batchpilot.data.prepare.prepare` from the JSON Lines file to a local shard set:
  reading, JSON parsing, tokenizing, the split and the shard writes, all in this process.
- prepare --workers N, N = 1 .. every usable core: wall seconds.

Per-core rows are in this process's CPU seconds (a shared machine's other work inflates wall seconds far
more), measured in `--pairs` back-to-back pairs with alternating order; the ratio is the median of the
pairs' ratios (target: prepare within 10% of encode_batch, i.e. >= 0.90). Scaling is wall seconds, the
best of `--repeats` (target >= 1.8x on 2 cores).

Run: .venv/bin/python bench/prepare_throughput.py [--corpus-mb 24] [--pairs 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers starts its thread pool: one thread here

from batchpilot.data.corpora import collect_sources
from batchpilot.data.prepare import _BATCH_BYTES, PrepareStats, prepare
from batchpilot.data.tokenizers import load_tokenizer, usable_cores

DOCUMENT_BYTES = 4096


def corpus_documents(target_bytes: int) -> list[str]:
    """Stdlib source cut into ~4 KB documents at line boundaries, cycled up to `target_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines, current = text.splitlines(keepends=True), []
        size = 0
        for line in lines:
            current.append(line)
            size += len(line)
            if size >= DOCUMENT_BYTES:
                documents.append("".join(current))
                current, size = [], 0
        if current:
            documents.append("".join(current))
    out, total = [], 0
    while total < target_bytes:
        for document in documents:
            out.append(document)
            total += len(document)
            if total >= target_bytes:
                break
    return out


def train_tokenizer(documents: list[str], path: Path, vocab_size: int) -> None:
    import tokenizers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample, size = [], 0
    for document in documents:
        sample.append(document)
        size += len(document)
        if size > 4 * 2**20:
            break
    model.train_from_iterator(sample, trainer=trainer)
    model.save(str(path))


def batches(documents: list[str]) -> list[list[str]]:
    """The documents in prepare's batches (about _BATCH_BYTES of text each)."""
    out: list[list[str]] = [[]]
    size = 0
    for document in documents:
        out[-1].append(document)
        size += len(document)
        if size >= _BATCH_BYTES:
            out.append([])
            size = 0
    return [batch for batch in out if batch]


def cpu_seconds(run: Callable[[], object]) -> float:
    started = time.process_time()
    run()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=float, default=24)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import tokenizers

    cores = usable_cores()
    print(
        f"machine: {cores} usable core(s), load average {os.getloadavg()[0]:.2f}, tokenizers {tokenizers.__version__}"
    )
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        documents = corpus_documents(int(args.corpus_mb * 2**20))
        corpus = folder / "corpus.jsonl"
        with corpus.open("w") as file:
            for document in documents:
                file.write(json.dumps({"text": document}) + "\n")
        train_tokenizer(documents, folder / "tokenizer.json", args.vocab_size)
        tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
        library = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        text_batches = batches(documents)
        print(f"corpus: {len(documents):,} documents, {corpus.stat().st_size / 1e6:.1f} MB of JSON Lines, "
              f"{len(text_batches)} batches; BPE vocabulary {tokenizer.vocab_size}")  # fmt: skip
        sources = collect_sources([str(corpus)])
        runs = 0

        def run_prepare(workers: int) -> PrepareStats:
            nonlocal runs
            runs += 1
            stats: list[PrepareStats] = []
            prepare(inputs=sources, out_uri=f"file://{folder}/out-{runs}", tokenizer=tokenizer,
                    shard_size_tokens=16 * 2**20, validation_fraction=0.01, workers=workers,
                    show_progress=False, stats=stats)  # fmt: skip
            return stats[0]

        def encode_all(method: str) -> None:
            encode = getattr(library, method)
            for batch in text_batches:
                for encoding in encode(batch, add_special_tokens=False):
                    len(encoding.ids)

        num_tokens = run_prepare(1).num_tokens  # warm-up; every run writes the same tokens
        print(f"tokens: {num_tokens:,} (end-of-document tokens included)\n")
        rows: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": [], "prepare_w1": []}
        ratios, fast_ratios = [], []
        for pair in range(args.pairs):
            order = ["encode_batch", "encode_batch_fast", "prepare_w1"]
            for name in order if pair % 2 == 0 else reversed(order):
                run = (lambda: run_prepare(1)) if name == "prepare_w1" else (lambda n=name: encode_all(n))
                rows[name].append(cpu_seconds(run))
            ratios.append(rows["encode_batch"][-1] / rows["prepare_w1"][-1])
            fast_ratios.append(rows["encode_batch_fast"][-1] / rows["prepare_w1"][-1])
        print("per core (CPU seconds of this process, median of the pairs)")
        print("| row | CPU s | tokens/s per core |\n| --- | ---: | ---: |")
        for name, seconds in rows.items():
            median = statistics.median(seconds)
            print(f"| {name} | {median:.2f} | {num_tokens / median:,.0f} |")
        print(f"\nprepare --workers 1 / encode_batch (throughput ratio, target >= 0.90): median "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]")  # fmt: skip
        print(f"prepare --workers 1 / encode_batch_fast: median {statistics.median(fast_ratios):.3f} "
              f"[{min(fast_ratios):.3f}..{max(fast_ratios):.3f}]\n")  # fmt: skip
        print("scaling (wall seconds, best of repeats; CPU seconds of this process and its workers)")
        print("| workers | wall s | tokens/s | speed-up over 1 | CPU s, all processes | cores busy |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        walls: dict[int, float] = {}
        for workers in sorted({1, *range(2, cores + 1)}):
            best = (float("inf"), 0.0)
            for _ in range(args.repeats):
                before = os.times()
                wall = run_prepare(workers).seconds
                after = os.times()
                cpu = sum(after[:4]) - sum(before[:4])  # user + system, this process and reaped workers
                best = min(best, (wall, cpu))
            walls[workers], cpu = best
            print(f"| {workers} | {walls[workers]:.2f} | {num_tokens / walls[workers]:,.0f} | "
                  f"{walls[1] / walls[workers]:.2f}x | {cpu:.2f} | {cpu / walls[workers]:.2f} |")  # fmt: skip
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
