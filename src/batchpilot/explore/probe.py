"""One measurement in a fresh process: `python -m batchpilot.explore.probe` (a ProbeRequest on stdin).

The process prints one line `RESULT_MARKER {json}` (a ProbeResult) on stdout and exits 0, whatever
happened to the measurement; the model's own prints cannot be mistaken for it. A fresh process per
probe means a CUDA out-of-memory error (or a fragmented allocator) cannot poison the next probe, and the
peak resident memory of the process is the peak of this one configuration.

On CPU there is no out-of-memory error to catch before the machine swaps or the kernel kills the
process, so a watchdog thread compares the resident set with `memory_budget_bytes` every few
milliseconds and ends the probe as soon as it is exceeded (the search then knows the size does not fit
without waiting for the whole step).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.explore.records import RESULT_MARKER, ProbeRequest, ProbeResult, timing_from_steps
from batchpilot.models.factory import build_model, set_activation_checkpointing
from batchpilot.train.step import micro_batch_loss
from batchpilot.train.trainer import autocast_factory, check_vocabulary, make_optimizer, peak_memory_bytes

WATCHDOG_INTERVAL_S = 0.005
MAX_TIMED_STEPS = 200
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def emit(payload: str) -> None:
    """Prints the one result line (flushes: the parent reads it even if the process is then killed)."""
    sys.stdout.write(f"\n{RESULT_MARKER} {payload}\n")
    sys.stdout.flush()


def resident_bytes() -> int:
    """The current resident set of this process (Linux /proc)."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * _PAGE_BYTES


@dataclass
class Session:
    """A model, its optimizer and the real data loader, set up for one probe or one study."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: TokenLoader
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    consumed_samples: int = 0

    def timed_pass(self, micro_batch_size: int, activation_checkpointing: bool | None = None) -> float:
        """Seconds of one forward + backward pass on the next micro batch; then an untimed optimizer step.

        `activation_checkpointing` switches the model first (None: leave it as it is).
        """
        if activation_checkpointing is not None:
            set_activation_checkpointing(self.model, activation_checkpointing)
        (batch,) = self.loader.micro_batches(
            consumed_samples=self.consumed_samples,
            global_batch_size=micro_batch_size,
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=1,
        )
        self.consumed_samples += micro_batch_size
        batch = batch.to(self.device)
        _synchronize(self.device)
        started = time.perf_counter()
        micro_batch_loss(self.model, batch, self.autocast()).backward()
        _synchronize(self.device)
        elapsed = time.perf_counter() - started
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return elapsed


@contextlib.contextmanager
def open_session(request: ProbeRequest) -> Iterator[Session]:
    """Opens the data and builds the model; user errors (dataset, factory) raise BatchpilotError."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and request.cpu_threads:
        torch.set_num_threads(request.cpu_threads)
    torch.manual_seed(request.seed)
    loader = TokenLoader(
        uri=request.data_uri,
        seq_len=request.seq_len,
        seed=request.seed,
        split=request.split,
        verify_checksums=request.verify_checksums,
    )
    try:
        try:
            model = build_model(factory=request.factory, args=request.model_args)
        except BatchpilotError:
            raise
        except Exception as error:  # the user's factory itself failed: no probe can succeed
            raise BatchpilotError(
                "model.factory", f"{request.factory} raised {type(error).__name__}: {error}"
            ) from None
        check_vocabulary(model, vocab_size=loader.vocab_size)
        set_activation_checkpointing(model, request.activation_checkpointing)
        model.to(device)
        model.train()
        optimizer = make_optimizer(model, weight_decay=0.0)
        if request.compile:
            model.compile()
        autocast = autocast_factory(device, request.precision)
        yield Session(model=model, optimizer=optimizer, loader=loader, device=device, autocast=autocast)
    finally:
        loader.close()


def _watch_memory(*, budget_bytes: int, result: ProbeResult, done: threading.Event) -> None:
    """Ends the process with a not-fitting result as soon as the resident set exceeds the budget."""
    while not done.wait(WATCHDOG_INTERVAL_S):
        current = resident_bytes()
        if current > budget_bytes:
            result.fits = False
            result.peak_memory_bytes = current
            result.error = (
                f"resident memory {current:,} bytes exceeded explore.memory_budget_bytes {budget_bytes:,}"
            )
            emit(result.to_json())
            os._exit(0)


def _timed_passes(session: Session, request: ProbeRequest) -> tuple[list[float], list[float]]:
    """Warm-up passes, then timed forward + backward passes (each followed by an untimed optimizer step).

    Returns:
        (pass times of the requested size, ratios of its throughput over the reference's pass next to
        each of them; empty without a reference).
    """
    micro = request.micro_batch_size
    reference = request.reference_micro_batch_size
    times_s: list[float] = []
    ratios: list[float] = []

    def one_pass(size: int, checkpointing: bool) -> float:
        # Only a paired probe switches the model between its setting and the reference's.
        return session.timed_pass(size, checkpointing if reference is not None else None)

    step = 0
    while True:
        timed = step - request.warmup_steps
        if timed >= MAX_TIMED_STEPS or (timed >= request.timed_steps and sum(times_s) >= request.min_timed_s):
            return times_s, ratios
        # With a reference, the two passes of a pair alternate in order, so neither always goes first.
        if reference is None:
            elapsed = one_pass(micro, request.activation_checkpointing)
        elif step % 2:
            reference_s = one_pass(reference, request.reference_activation_checkpointing)
            elapsed = one_pass(micro, request.activation_checkpointing)
        else:
            elapsed = one_pass(micro, request.activation_checkpointing)
            reference_s = one_pass(reference, request.reference_activation_checkpointing)
        if timed >= 0:
            times_s.append(elapsed)
            if reference is not None:
                ratios.append((micro / elapsed) / (reference / reference_s))
        step += 1


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(request: ProbeRequest) -> ProbeResult:
    """Runs the probe in this process and returns its result (never raises for a failed measurement)."""
    result = ProbeResult.not_fitting(request)
    done = threading.Event()
    try:
        with open_session(request) as session:
            result.device = session.device.type
            if session.device.type == "cpu":
                watchdog = threading.Thread(
                    target=_watch_memory,
                    kwargs={"budget_bytes": request.memory_budget_bytes, "result": result, "done": done},
                    daemon=True,
                )
                watchdog.start()
            else:
                torch.cuda.reset_peak_memory_stats(session.device)
            times_s, ratios = _timed_passes(session, request)
            done.set()
            result.peak_memory_bytes = peak_memory_bytes(session.device)
            result.__dict__.update(
                timing_from_steps(
                    step_times_s=times_s, micro_batch_size=request.micro_batch_size, seq_len=request.seq_len
                )
            )
            result.pair_ratios = ratios
            if ratios:
                result.relative_throughput = statistics.median(ratios)
            over = session.device.type == "cpu" and result.peak_memory_bytes > request.memory_budget_bytes
            result.fits = not over
            if over:
                result.error = (
                    f"peak resident memory {result.peak_memory_bytes:,} bytes exceeds "
                    f"explore.memory_budget_bytes {request.memory_budget_bytes:,}"
                )
    except BatchpilotError as error:
        result.user_error = str(error)
    except torch.cuda.OutOfMemoryError:
        result.error = "CUDA out of memory"
        with contextlib.suppress(Exception):
            result.peak_memory_bytes = int(torch.cuda.max_memory_allocated())
    except MemoryError:
        result.error = "out of memory (MemoryError)"
    except Exception as error:  # a crash of this configuration: recorded, the search goes on
        result.error = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    finally:
        done.set()
    return result


def main() -> int:
    """Reads a ProbeRequest from stdin, prints the one result line, exits 0."""
    started = time.perf_counter()
    request = ProbeRequest.from_json(sys.stdin.read())
    result = measure(request)
    result.duration_s = time.perf_counter() - started
    emit(result.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
