"""One measurement in a fresh process: `python -m batchpilot.explore.probe` (a ProbeRequest on stdin).

The process prints one line `RESULT_MARKER {json}` (a ProbeResult) on stdout and exits 0, whatever
happened to the measurement; the model's own prints cannot be mistaken for it. A fresh process per
probe means a CUDA out-of-memory error (or a fragmented allocator) cannot poison the next probe, and the
peak resident memory of the process is the peak of this one configuration.

Under fsdp/hsdp a probe is `ProbeRequest.processes` such processes (one per device of a node, see
process.py): each joins the process group, reads its own samples (with tensor parallelism, its group's),
runs the trainer's sharded passes and reports its own peak; the pass times are the slowest rank's. A rank that runs out of memory reports it
and exits; its peers, stuck in its collectives, are killed by the parent.

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
import torch.distributed as dist
from torch import nn

from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.explore.records import (
    RESULT_MARKER,
    ProbeRequest,
    ProbeResult,
    factory_errors,
    pair_ratios,
    timing_from_steps,
)
from batchpilot.models.deferred import build_deferred, reset_buffers, to_empty
from batchpilot.models.factory import build_model, compile_model, set_activation_checkpointing
from batchpilot.train.distributed import DistContext
from batchpilot.train.eager import autocast_factory, peak_memory_bytes, uses_bf16
from batchpilot.train.parallel import Parallel, Strategy, wrap_model
from batchpilot.train.setup import check_vocabulary, make_optimizer
from batchpilot.train.step import UnagreedOutOfMemory, accumulate_gradients

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
    """A model as the stages run it (wrapped by the strategy), its optimizer and this rank's real data.

    Attributes:
        model: the model (under fsdp/hsdp its parameters are this rank's shards).
        parallel: the strategy's wrapping (the bare model on one process).
        ctx: this process's rank and device; a pass reads `micro x world` samples, this rank's share.
    """

    model: nn.Module
    parallel: Parallel
    ctx: DistContext
    optimizer: torch.optim.Optimizer
    loader: TokenLoader
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    consumed_samples: int = 0

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each take their own micro batch (a tensor-parallel group shares one)."""
        return self.ctx.world_size // self.parallel.tensor_parallel_size

    def next_micro_batches(self, micro_batch_size: int, accumulation: int = 1) -> list[torch.Tensor]:
        """This rank's micro batches of the next `micro x data-parallel ranks x accumulation` samples, on the
        device."""
        global_batch_size = micro_batch_size * self.data_parallel_size * accumulation
        batches = self.loader.micro_batches(
            consumed_samples=self.consumed_samples,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=accumulation,
        )
        self.consumed_samples += global_batch_size
        return [batch.to(self.device) for batch in batches]

    def backward(self, micro_batches: list[torch.Tensor]) -> None:
        """The trainer's forward + backward passes (`accumulate_gradients`, under the strategy).

        Raises:
            torch.cuda.OutOfMemoryError: this rank ran out of memory (inside a sharded pass the other
                ranks cannot be told: the parent ends the whole probe).
        """
        try:
            outcome = accumulate_gradients(
                model=self.model,
                parallel=self.parallel,
                micro_batches=micro_batches,
                ctx=self.ctx,
                autocast=self.autocast,
                measure_noise=False,
                measure_coherence=False,
            )
        except UnagreedOutOfMemory:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory inside a sharded pass") from None
        if not outcome.completed:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    def timed_pass(self, micro_batch_size: int, activation_checkpointing: bool | None = None) -> float:
        """Seconds of one forward + backward pass on the next micro batch; then an untimed optimizer step.

        `activation_checkpointing` switches the model first (None: leave it as it is).
        """
        if activation_checkpointing is not None:
            set_activation_checkpointing(self.model, activation_checkpointing)
        batches = self.next_micro_batches(micro_batch_size)
        _synchronize(self.device)
        started = time.perf_counter()
        self.backward(batches)
        _synchronize(self.device)
        elapsed = time.perf_counter() - started
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return elapsed


@contextlib.contextmanager
def open_session(request: ProbeRequest) -> Iterator[Session]:
    """Joins the probe's process group, opens this rank's data, builds and wraps the model as the trainer
    does; user errors (dataset, factory) raise BatchpilotError."""
    ctx = DistContext.from_env()
    if ctx.device.type == "cpu" and request.cpu_threads:
        torch.set_num_threads(request.cpu_threads)
    torch.manual_seed(request.seed)
    tp = (
        request.tensor_parallel_size
    )  # a tensor-parallel group's ranks read their data-parallel rank's samples
    loader = TokenLoader(
        uri=request.data_uri,
        seq_len=request.seq_len,
        seed=request.seed,
        rank=ctx.rank // tp,
        world_size=ctx.world_size // tp,
        local_world_size=ctx.local_world_size // tp,
        split=request.split,
        verify_checksums=request.verify_checksums,
    )
    try:
        with factory_errors(request.factory):  # on meta, as the trainer builds it: each rank fills its part
            deferred = build_deferred(lambda: build_model(factory=request.factory, args=request.model_args))
        model = deferred.model
        check_vocabulary(model, vocab_size=loader.vocab_size)
        set_activation_checkpointing(model, request.activation_checkpointing)
        model.train()
        if request.compile:
            compile_model(model)

        def materialize(placed: nn.Module) -> None:
            to_empty(placed, device=ctx.device)
            if request.init_from is None:
                torch.manual_seed(request.seed)
                deferred.initialize(placed)
            else:
                reset_buffers(placed)
                _load_init_from(placed, source=request.init_from, local_rank=ctx.local_rank)

        strategy: Strategy = request.parallelism  # type: ignore[assignment]
        bf16 = uses_bf16(ctx.device, request.precision)
        parallel = wrap_model(
            model, ctx, strategy=strategy, bf16=bf16, materialize=materialize, tensor_parallel_size=tp
        )
        optimizer = make_optimizer(model, weight_decay=0.0)  # after sharding: on the shards
        autocast = autocast_factory(ctx.device, request.precision, parallel)
        yield Session(
            model=model, parallel=parallel, ctx=ctx, optimizer=optimizer, loader=loader, autocast=autocast
        )
    finally:
        loader.close()


def _load_init_from(model: nn.Module, *, source: str, local_rank: int) -> None:
    """`train.init_from`'s weights into the freshly built model; a gs:// folder through the node's cache,
    shared with the trainer (local rank 0 downloads it, the other local ranks wait for it)."""
    from batchpilot.train.init_from import init_from_folder, load_weights

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    folder = init_from_folder(source, local_rank=local_rank, say=say)
    loaded = load_weights(model, folder=folder)
    say(f"the study's model starts from {source} ({loaded} tensors of a Hugging Face Llama checkpoint)")


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

    Every rank runs the same passes: whether to go on is agreed between passes (outside the timing).

    Returns:
        (pass times of the requested size, the reference's pass time next to each; empty without one).
    """
    micro = request.micro_batch_size
    reference = request.reference_micro_batch_size
    times_s: list[float] = []
    reference_times_s: list[float] = []

    def one_pass(size: int, checkpointing: bool) -> float:
        # Only a paired probe switches the model between its setting and the reference's.
        return session.timed_pass(size, checkpointing if reference is not None else None)

    step = 0
    while True:
        timed = step - request.warmup_steps
        enough = timed >= request.timed_steps and sum(times_s) >= request.min_timed_s
        if timed >= MAX_TIMED_STEPS or session.ctx.any_true(enough)[0]:
            return times_s, reference_times_s
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
                reference_times_s.append(reference_s)
        step += 1


def slowest_rank(ctx: DistContext, values: list[float]) -> list[float]:
    """Element-wise maximum over ranks: a pass of a multi-process probe lasts as long as its slowest rank."""
    if not ctx.distributed or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(value) for value in tensor.tolist()]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_memory_watch(session: Session, request: ProbeRequest, result: ProbeResult) -> threading.Event:
    """CPU: the budget watchdog thread; CUDA: a fresh peak. Set the returned event to stop watching."""
    done = threading.Event()
    if session.device.type == "cpu":
        watchdog = threading.Thread(
            target=_watch_memory,
            kwargs={"budget_bytes": request.memory_budget_bytes, "result": result, "done": done},
            daemon=True,
        )
        watchdog.start()
    else:
        torch.cuda.reset_peak_memory_stats(session.device)
    return done


def _record_timing(session: Session, request: ProbeRequest, result: ProbeResult) -> None:
    """Runs the passes and fills in the timing (each pass as long as its slowest rank) and this rank's peak."""
    done = _start_memory_watch(session, request, result)
    try:
        times_s, reference_times_s = _timed_passes(session, request)
    finally:
        done.set()
    result.peak_memory_bytes = peak_memory_bytes(session.device)
    slowest = slowest_rank(session.ctx, times_s + reference_times_s)
    times_s, reference_times_s = slowest[: len(times_s)], slowest[len(times_s) :]
    result.__dict__.update(
        timing_from_steps(
            step_times_s=times_s,
            micro_batch_size=request.micro_batch_size,
            seq_len=request.seq_len,
            tensor_parallel_size=request.tensor_parallel_size,
        )
    )
    if request.reference_micro_batch_size is not None:
        result.pair_ratios = pair_ratios(
            times_s=times_s,
            reference_times_s=reference_times_s,
            micro_batch_size=request.micro_batch_size,
            reference_micro_batch_size=request.reference_micro_batch_size,
        )
        result.relative_throughput = statistics.median(result.pair_ratios)


def measure(request: ProbeRequest) -> ProbeResult:
    """Runs this rank's part of the probe and returns its result (never raises for a failed measurement).

    The peak is this rank's own (the parent takes the largest over ranks); samples/s is per device: each
    rank passes `micro_batch_size` samples in a pass's time.
    """
    result = ProbeResult.not_fitting(request)
    try:
        with open_session(request) as session:
            result.device = session.device.type
            _record_timing(session, request, result)
            over = (
                session.device.type == "cpu" and (result.peak_memory_bytes or 0) > request.memory_budget_bytes
            )
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
    return result


def main() -> int:
    """Reads a ProbeRequest from stdin, prints the one result line, exits 0."""
    started = time.perf_counter()
    request = ProbeRequest.from_json(sys.stdin.read())
    result = measure(request)
    result.duration_s = time.perf_counter() - started
    emit(result.to_json())
    end_process_group()
    return 0


def end_process_group() -> None:
    """Leaves the probe's process group, if any (every rank reported; nothing more is exchanged)."""
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
