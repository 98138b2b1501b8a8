"""Host memory a rank needs to build and shard the model: the meta-device build against the whole-model one.

Four gloo processes on the CPU (one thread each) shard a Llama of about 0.7B parameters with fsdp, in two
ways, each in fresh processes:
- `whole` (the trainer before the meta-device build): every rank builds the whole fp32 model on the CPU
  under the seed, then `fully_shard` splits it (`wrap_model`);
- `meta` (the trainer now): every rank builds on `meta`, shards, gives its shards memory and replays the
  initialisation (`models/deferred.py`), one whole tensor at a time.

A rank's figure is the peak resident memory it adds while building and sharding: `ru_maxrss` at the end
minus its resident set just before the build (the interpreter, torch and the process group left out), over
the whole model's fp32 bytes; the row prints the largest over the ranks. Target: meta <= 0.35 (its shard,
a quarter, plus the largest tensor, the embedding); whole >= 1. Both ways must give every rank the same
shards (checked: each parameter's local sum, in float64). Runs are interleaved (whole, meta, whole, ...)
so that a shared machine's drift touches both alike.

Run: .venv/bin/python bench/startup_memory.py [--pairs 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpilot.models.deferred import build_deferred, to_empty
from batchpilot.models.factory import build_model
from batchpilot.train.parallel import wrap_model
from local_ranks import free_port, join

FACTORY = "batchpilot.models.llama:build"
MODEL = {
    "n_layer": 24, "n_head": 12, "n_kv_head": 4, "n_embd": 1536, "ffn_hidden_size": 4096, "vocab_size": 32000,
    "max_seq_len": 2048,
}  # fmt: skip
WORLD = 4
SEED = 0
TARGET_META = 0.35


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, port: int, way: str, out: str) -> None:
    ctx = join(rank, WORLD, port)
    dist.barrier()
    before = resident_bytes()
    if way == "whole":
        torch.manual_seed(SEED)
        model = build_model(factory=FACTORY, args=MODEL)
        wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=lambda _: None)
    else:
        deferred = build_deferred(lambda: build_model(factory=FACTORY, args=MODEL))
        model = deferred.model

        def materialize(placed: torch.nn.Module) -> None:
            to_empty(placed, device="cpu")
            torch.manual_seed(SEED)
            deferred.initialize(placed)

        wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=materialize)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    sums = [float(p.detach().to_local().double().sum()) for p in model.parameters()]
    torch.save({"added_bytes": peak - before, "sums": sums}, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def measure(way: str, folder: Path) -> tuple[int, list[list[float]]]:
    """(the largest added peak over the ranks, each rank's parameter sums) of one run of `way`."""
    out = folder / way
    mp.spawn(_worker, args=(free_port(), way, str(out)), nprocs=WORLD, join=True)
    results = [torch.load(f"{out}.rank{rank}") for rank in range(WORLD)]
    return max(r["added_bytes"] for r in results), [r["sums"] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in build_model(factory=FACTORY, args=MODEL).parameters())
    model_bytes = num_params * 4
    print(f"Llama of {num_params / 1e9:.2f}B parameters ({model_bytes / 2**30:.2f} GiB in fp32), fsdp over {WORLD} "
          "gloo processes")  # fmt: skip
    ratios: dict[str, list[float]] = {"whole": [], "meta": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            sums = {}
            for way in ("whole", "meta") if pair % 2 == 0 else ("meta", "whole"):
                added, sums[way] = measure(way, Path(tmp))
                ratios[way].append(added / model_bytes)
                print(f"  pair {pair + 1}: {way:5s} peak added per rank {added / 2**30:.2f} GiB = "
                      f"{added / model_bytes:.3f} of the model", flush=True)  # fmt: skip
            assert sums["whole"] == sums["meta"], "the two ways gave different shards"
    whole, meta = statistics.median(ratios["whole"]), statistics.median(ratios["meta"])
    print(f"whole-model build: {whole:.3f} of the model's fp32 bytes per rank (median of {args.pairs})")
    print(f"meta-device build: {meta:.3f} (target <= {TARGET_META}), {meta / whole:.3f}x the whole-model build's; "
          "identical shards")  # fmt: skip
    if meta > TARGET_META:
        raise SystemExit(
            f"meta-device build: {meta:.3f} of the model per rank, above the target {TARGET_META}"
        )


if __name__ == "__main__":
    main()
