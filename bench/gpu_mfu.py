"""MFU and tokens/s of the trainer on one GPU (bf16) against a bare PyTorch loop, measured in the same run.

A GPT of about 300M parameters (24 layers, width 1024, 1024 tokens) trains with bf16 autocast: the
batchpilot trainer (in this process, world size 1) and a bare loop with the same model, optimizer,
micro batch and accumulation. MFU = tokens/s x training FLOPs per token (6N + attention) / the device's
dense bf16 peak. It needs a CUDA GPU (CI has none and never runs it); record what it prints, and the GPU,
in docs/status.md.

Run: python bench/gpu_mfu.py [--steps 20] [--repeats 3] [--micro-batch 16]
"""

from __future__ import annotations

import argparse
import sys

import torch

from batchpilot.models.factory import build_model
from batchpilot.planning.flops import flops_per_token, mfu, peak_bf16_flops
from trainer_overhead import Setup, measure

MODEL = {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "vocab_size": 257}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="extra steps of the longer trainer run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_mfu.py needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0)
    setup = Setup(MODEL, args.micro_batch * args.accumulation, args.micro_batch, MODEL["block_size"])
    num_params = sum(
        p.numel() for p in build_model(factory="batchpilot.models.gpt:build", args=MODEL).parameters()
    )
    per_token = flops_per_token(
        num_params=num_params, num_layers=MODEL["n_layer"], hidden_size=MODEL["n_embd"], seq_len=setup.seq_len
    )
    peak = peak_bf16_flops(device_name)
    trainer_s, bare_s = measure(setup, steps=args.steps, repeats=args.repeats)
    print(
        f"{device_name}, torch {torch.__version__}, bf16 autocast; GPT {num_params / 1e6:.0f}M parameters "
        f"({MODEL['n_layer']}x{MODEL['n_embd']}), global batch {setup.global_batch} = micro {setup.micro_batch} x 1 "
        f"x accumulation {args.accumulation}, seq_len {setup.seq_len}; median of {args.repeats}"
    )
    for name, seconds in (("bare PyTorch loop", bare_s), ("batchpilot trainer", trainer_s)):
        tokens_per_s = setup.tokens_per_step / seconds
        utilisation = (
            f", MFU {mfu(tokens_per_s=tokens_per_s, flops_per_token=per_token, peak_flops=peak):.1%}"
            if peak
            else " (peak FLOPs of this device unknown: no MFU)"
        )
        print(f"{name:>19}: {seconds * 1000:8.1f} ms/step, {tokens_per_s:,.0f} tokens/s{utilisation}")
    print(f"trainer / bare loop throughput ratio: {bare_s / trainer_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
