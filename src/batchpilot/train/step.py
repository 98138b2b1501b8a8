"""One optimizer step's forward/backward passes with gradient accumulation.

Each micro-batch's loss is the mean token loss of its samples divided by the accumulation steps, and
DDP averages over ranks, so the accumulated gradient is the gradient of the mean loss over the global
batch whatever the split (world x accumulation x micro). DDP synchronises only on the last micro-batch
(`no_sync` on the others).

Out of memory (CUDA): all ranks agree after every micro-batch (and before the last, synchronising
backward) whether any rank ran out; if so, every rank drops the step's partial gradients and the trainer
retries the same global batch with half the micro batch. An OOM *inside* the last micro-batch's backward
cannot be agreed on (the other ranks are already in its all-reduce), so it fails the job; the stage then
restarts from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from batchpilot.train.distributed import DistContext

# Testing hook: simulate a device on which micro-batches larger than this run out of memory (rank 0).
INJECT_OOM_ENV = "BATCHPILOT_INJECT_OOM_ABOVE_MICRO_BATCH"


@dataclass
class LocalNormHook:
    """DDP communication hook state: the squared norm of this rank's gradient before the all-reduce."""

    world_size: int
    sq_norm: torch.Tensor | None = None

    def reset(self) -> None:
        self.sq_norm = None


def _allreduce_with_local_norm(state, bucket):
    """DDP's default mean all-reduce, recording the local squared norm on the way (one norm per bucket).

    No annotations: DDP compares them with `dist.GradBucket` at run time, and postponed (string)
    annotations would fail that check.
    """
    buffer = bucket.buffer()
    # float64: DDP regroups buckets after its first iteration, so the per-bucket sums must not depend on grouping.
    local = buffer.detach().double().pow(2).sum()
    state.sq_norm = local if state.sq_norm is None else state.sq_norm + local
    buffer.div_(state.world_size)
    future = dist.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def wrap_model(model: nn.Module, ctx: DistContext) -> tuple[nn.Module, LocalNormHook | None]:
    """DDP across ranks (with the local-norm hook) or the bare model on one rank."""
    _install_oom_injection(model, ctx)
    if not ctx.distributed:
        return model, None
    hook = LocalNormHook(world_size=ctx.world_size)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    ddp.register_comm_hook(hook, _allreduce_with_local_norm)
    return ddp, hook


@dataclass
class StepOutcome:
    """What happened in one attempt at an optimizer step (gradients are ready only if `completed`)."""

    completed: bool
    loss: float = 0.0
    small_sq_norm: float | None = None
    small_batch: int | None = None
    coherence: float | None = None
    out_of_memory: bool = False
    stopped: bool = False


def _grad_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten().float() for p in model.parameters() if p.grad is not None])


def _install_oom_injection(model: nn.Module, ctx: DistContext) -> None:
    """Testing hook (INJECT_OOM_ENV): rank 0 raises a CUDA OOM inside forward for larger micro-batches.

    It fires inside the module's forward, after DDP's own pre-forward work, as a real OOM would.
    """
    limit = os.environ.get(INJECT_OOM_ENV)
    if limit is None or ctx.rank != 0:
        return

    def fail_when_too_big(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if inputs[0].shape[0] > int(limit):
            raise torch.cuda.OutOfMemoryError(f"injected: micro batch {inputs[0].shape[0]} > {limit}")

    model.register_forward_pre_hook(fail_when_too_big)


def micro_batch_loss(
    model: nn.Module, batch: torch.Tensor, autocast: contextlib.AbstractContextManager
) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch `[micro, seq_len + 1]`."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with autocast:
        logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _forward(
    ctx: DistContext, wrapped: nn.Module, batch: torch.Tensor, autocast: Callable[[], Any]
) -> torch.Tensor | None:
    """The micro-batch loss, or None when the device ran out of memory."""
    try:
        return micro_batch_loss(wrapped, batch.to(ctx.device, non_blocking=True), autocast())
    except torch.cuda.OutOfMemoryError:
        return None


def _arm_gradient_sync(wrapped: nn.Module) -> None:
    """What DDP's forward does when it is not under no_sync: the next backward all-reduces the gradients."""
    assert isinstance(wrapped, DistributedDataParallel)
    wrapped.require_forward_param_sync = True
    wrapped.reducer.prepare_for_backward([])


def _backward(loss: torch.Tensor, *, may_fail: bool) -> bool:
    """Backpropagates; an OOM returns False where it can be agreed on (not inside the synchronising pass)."""
    try:
        loss.backward()
    except torch.cuda.OutOfMemoryError:
        if not may_fail:
            raise
        return False
    return True


def _abandon(model: nn.Module, *, out_of_memory: bool) -> StepOutcome:
    """Drops the partial gradients of an attempt that all ranks agreed to stop."""
    model.zero_grad(set_to_none=True)
    return StepOutcome(completed=False, out_of_memory=out_of_memory, stopped=not out_of_memory)


def accumulate_gradients(
    *,
    model: nn.Module,
    wrapped: nn.Module,
    hook: LocalNormHook | None,
    micro_batches: Sequence[torch.Tensor],
    ctx: DistContext,
    autocast: Callable[[], contextlib.AbstractContextManager],
    stop_requested: Callable[[], bool],
    measure_noise: bool,
    measure_coherence: bool,
) -> StepOutcome:
    """Runs every micro-batch; agrees with all ranks on OOM or stop requests at each boundary."""
    accumulation = len(micro_batches)
    micro = micro_batches[0].shape[0]
    total_loss = 0.0
    outcome = StepOutcome(completed=False)
    first_grad: torch.Tensor | None = None
    # Gradients stay rank-local until the last micro-batch's backward synchronises them.
    noise_from_first = measure_noise and accumulation > 1 and not ctx.distributed
    coherence_local = measure_coherence and (accumulation > 2 or (accumulation > 1 and not ctx.distributed))
    if hook is not None:
        hook.reset()
    for index, batch in enumerate(micro_batches):
        last = index == accumulation - 1
        # Every forward runs without arming DDP's reducer; the last micro-batch arms it only once all ranks
        # agree that their forward fit, so an abandoned attempt never leaves the reducer half-armed.
        with wrapped.no_sync() if ctx.distributed else contextlib.nullcontext():  # type: ignore[operator]
            loss = _forward(ctx, wrapped, batch, autocast)
        if last and ctx.any_true(loss is None)[0]:
            return _abandon(model, out_of_memory=True)
        if last and ctx.distributed:
            _arm_gradient_sync(wrapped)
        with wrapped.no_sync() if ctx.distributed and not last else contextlib.nullcontext():  # type: ignore[operator]
            out_of_memory = loss is None or not _backward(loss / accumulation, may_fail=not last)
        if not last:
            oom_anywhere, stop = ctx.any_true(out_of_memory, stop_requested())
            if oom_anywhere or stop:
                return _abandon(model, out_of_memory=oom_anywhere)
        assert loss is not None
        total_loss += loss.item()
        if index == 0 and (noise_from_first or coherence_local):
            first_grad = _grad_vector(model) * accumulation  # the mean gradient of this micro-batch
        if index == 1 and first_grad is not None and coherence_local:
            second = _grad_vector(model) * accumulation - first_grad
            outcome.coherence = float(F.cosine_similarity(first_grad, second, dim=0))
    outcome.completed = True
    outcome.loss = total_loss / accumulation
    if measure_noise and hook is not None and hook.sq_norm is not None:
        outcome.small_sq_norm, outcome.small_batch = float(hook.sq_norm), micro * accumulation
    elif noise_from_first and first_grad is not None:
        outcome.small_sq_norm, outcome.small_batch = float(first_grad.pow(2).sum()), micro
    return outcome
