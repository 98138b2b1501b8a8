"""MFU and tokens/s of the trainer on one GPU (bf16) against a bare PyTorch loop, measured in the same run.

A Llama of about 1B parameters (16 blocks, width 2048, 32 query and 8 key/value heads, SwiGLU 8192, 2048
tokens; the demo data's 257-token vocabulary keeps the embedding small) trains with bf16 autocast,
torch.compile on each block and fused AdamW (make_optimizer on CUDA): the batchpilot trainer (in this
process, world size 1) and a bare loop with the same model, compile, optimizer, micro batch and
accumulation, in pairs run back to back (alternating which goes first). MFU = tokens/s x training FLOPs
per token (6N + attention) / the device's dense bf16 peak. Target (bench/README.md): MFU >= 45% on one
H100 with the trainer within 5% of its bare loop. It needs a CUDA GPU (CI has none and never runs it);
record what it prints, and the GPU, in docs/status.md and bench/README.md.

Run: python bench/gpu_mfu.py [--model llama-1b|gpt-300m] [--no-compile] [--steps 10] [--pairs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from batchpilot.planning.flops import flops_per_token, mfu, peak_bf16_flops
from batchpilot.train.shape import model_shape
from trainer_overhead import Setup, measure

MODELS = {
    "llama-1b": (
        "batchpilot.models.llama:build",
        {"n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048, "ffn_hidden_size": 8192,
         "max_seq_len": 2048, "vocab_size": 257},
        2048,
    ),
    "gpt-300m": (
        "batchpilot.models.gpt:build",
        {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "vocab_size": 257},
        1024,
    ),
}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-1b")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile off on both sides")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    parser.add_argument("--pairs", type=int, default=3, help="trainer/bare pairs, back to back")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_mfu.py needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0)
    factory, model_args, seq_len = MODELS[args.model]
    setup = Setup(
        model_args, args.micro_batch * args.accumulation, args.micro_batch, seq_len, factory=factory,
        compile=not args.no_compile,
    )  # fmt: skip
    shape = model_shape(factory=factory, args=model_args)  # N without the embedding lookups (torchtitan's)
    per_token = flops_per_token(
        num_params=shape.matmul_params,
        num_layers=model_args["n_layer"],
        hidden_size=model_args["n_embd"],
        seq_len=seq_len,
    )
    peak = peak_bf16_flops(device_name)
    pairs = measure(setup, steps=args.steps, pairs=args.pairs)
    trainer_s = statistics.median(t for t, _ in pairs)
    bare_s = statistics.median(b for _, b in pairs)
    ratios = [b / t for t, b in pairs]
    print(
        f"{device_name}, torch {torch.__version__}, bf16 autocast, fused AdamW, "
        f"{'torch.compile per block' if setup.compile else 'no compile'}; {args.model} {shape.num_params / 1e6:.0f}M "
        f"parameters ({shape.matmul_params / 1e6:.0f}M multiply: MFU counts those), global batch {setup.global_batch} = micro {setup.micro_batch} x accumulation "
        f"{args.accumulation}, seq_len {seq_len}; medians of {args.pairs} pairs"
    )
    for name, seconds in (("bare PyTorch loop", bare_s), ("batchpilot trainer", trainer_s)):
        tokens_per_s = setup.tokens_per_step / seconds
        utilisation = (
            f", MFU {mfu(tokens_per_s=tokens_per_s, flops_per_token=per_token, peak_flops=peak):.1%}"
            if peak
            else " (peak FLOPs of this device unknown: no MFU)"
        )
        print(f"{name:>19}: {seconds * 1000:8.1f} ms/step, {tokens_per_s:,.0f} tokens/s{utilisation}")
    print(
        f"trainer / bare loop throughput ratio: median {statistics.median(ratios):.3f} "
        f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
