"""How far apart a recorded noise trace's steps are from independent (#38 item 2, groundwork).

The adaptive rule's standard error (`planning.adaptive.jackknife_stderr`) treats the single-step estimates
of |G|^2 and S in its window as independent. This reads a recorded trace (a run's metrics.jsonl, or a trace
kept under tests/fixtures/) and prints, for each batch size with enough steps: the pooled noise scale, the
autocorrelation at lags 1-3 of the window's linearised residual `s - R g2` (R: the pooled ratio), detrended
by a centred moving average of 101 steps (the noise scale drifts as training goes), the integrated
autocorrelation time `tau = 1 + 2 sum rho_k` (lags summed up to the first non-positive one: Geyer's
initial positive sequence), and the mean over windows of the rule's length of the leave-one-out jackknife's
standard error beside a block jackknife's (blocks of `ceil(tau)` steps, at least 2): how much the
independence assumption understates the error.

Run: .venv/bin/python bench/noise_traces.py [TRACE ...]   (default: tests/fixtures/noise_trace_*.json)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from batchpilot.planning.adaptive import NoisePoint, jackknife_stderr, window

TRACES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SMOOTHING = 0.95  # the trainer's and the demo's
DETREND = 101
MIN_STEPS = 3 * DETREND


def read_trace(path: Path) -> list[dict]:
    """Steps with noise terms: a kept trace (`columns` and `rows`) or a metrics.jsonl."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        rows = [dict(zip(doc["columns"], row, strict=True)) for row in doc["rows"]]
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("record") is None and r.get("noise_g2") is not None]


def autocorrelations(values: np.ndarray, lags: int = 20) -> list[float]:
    trend = np.convolve(values, np.ones(DETREND) / DETREND, mode="same")
    detrended = (values - trend)[DETREND:-DETREND]
    return [float(np.corrcoef(detrended[:-k], detrended[k:])[0, 1]) for k in range(1, lags + 1)]


def integrated_time(rho: list[float]) -> float:
    total = 0.0
    for value in rho:
        if value <= 0:
            break
        total += value
    return 1 + 2 * total


def block_jackknife(g2: np.ndarray, s: np.ndarray, block: int) -> float | None:
    """Standard error of mean(s) / mean(g2), deleting one block of `block` consecutive steps at a time."""
    blocks = len(g2) // block
    if blocks < 3:
        return None
    g2, s = g2[: blocks * block], s[: blocks * block]
    total_g2, total_s = g2.sum(), s.sum()
    if total_g2 <= 0 or total_s <= 0:
        return None
    estimates = []
    for b in range(blocks):
        part = slice(b * block, (b + 1) * block)
        rest = total_g2 - g2[part].sum()
        if rest <= 0:
            return None
        estimates.append((total_s - s[part].sum()) / rest)
    estimates_arr = np.array(estimates)
    return float(math.sqrt((blocks - 1) / blocks * ((estimates_arr - estimates_arr.mean()) ** 2).sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path)
    args = parser.parse_args()
    traces = args.traces or sorted(TRACES.glob("noise_trace_*.json"))
    length = window(SMOOTHING)
    print(f"windows of {length} steps (smoothing {SMOOTHING}); residuals detrended over {DETREND} steps")
    print(
        "trace | batch | steps | pooled B_simple | rho lag 1, 2, 3 | tau | mean stderr: leave-one-out / block"
    )
    for path in traces:
        rows = read_trace(path)
        for batch in sorted({r["global_batch_size"] for r in rows}):
            part = [r for r in rows if r["global_batch_size"] == batch]
            if len(part) < MIN_STEPS:
                continue
            g2 = np.array([r["noise_g2"] for r in part])
            s = np.array([r["noise_s"] for r in part])
            ratio = s.sum() / g2.sum()
            rho = autocorrelations(s - ratio * g2)
            tau = integrated_time(rho)
            block = max(2, math.ceil(tau))
            loo, blocked = [], []
            for end in range(length, len(part) + 1, length):
                points = [
                    NoisePoint(0, float(a), float(b))
                    for a, b in zip(g2[end - length : end], s[end - length : end], strict=True)
                ]
                one, other = (
                    jackknife_stderr(points),
                    block_jackknife(g2[end - length : end], s[end - length : end], block),
                )
                if one is not None and other is not None:
                    loo.append(one)
                    blocked.append(other)
            errors = (
                f"{np.mean(loo):.2f} / {np.mean(blocked):.2f} (blocks of {block}, {len(loo)} windows)"
                if loo
                else "-"
            )
            print(
                f"{path.name} | {batch} | {len(part)} | {ratio:.2f} | "
                f"{rho[0]:+.3f}, {rho[1]:+.3f}, {rho[2]:+.3f} | {tau:.2f} | {errors}"
            )


if __name__ == "__main__":
    main()
