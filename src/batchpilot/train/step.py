"""One optimizer step's forward/backward passes with gradient accumulation.

Each micro-batch's loss is the mean token loss of its samples divided by the accumulation steps, and
DDP averages over ranks, so the accumulated gradient is the gradient of the mean loss over the global
batch whatever the split (world x accumulation x micro). DDP synchronises only on the last micro-batch
(`no_sync` on the others).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    local = buffer.detach().float().pow(2).sum()
    state.sq_norm = local if state.sq_norm is None else state.sq_norm + local
    buffer.div_(state.world_size)
    future = dist.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def wrap_model(model: nn.Module, ctx: DistContext) -> tuple[nn.Module, LocalNormHook | None]:
    """DDP across ranks (with the local-norm hook) or the bare model on one rank."""
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


def _maybe_inject_oom(ctx: DistContext, micro_batch_size: int) -> None:
    limit = os.environ.get(INJECT_OOM_ENV)
    if limit is not None and ctx.rank == 0 and micro_batch_size > int(limit):
        raise torch.cuda.OutOfMemoryError(f"injected: micro batch {micro_batch_size} > {limit}")


def micro_batch_loss(
    model: nn.Module, batch: torch.Tensor, autocast: contextlib.AbstractContextManager
) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch `[micro, seq_len + 1]`."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with autocast:
        logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


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
        sync = contextlib.nullcontext() if last or not ctx.distributed else wrapped.no_sync()  # type: ignore[operator]
        out_of_memory = False
        with sync:
            try:
                _maybe_inject_oom(ctx, micro)
                loss = micro_batch_loss(wrapped, batch.to(ctx.device, non_blocking=True), autocast())
                (loss / accumulation).backward()
                total_loss += loss.item()
            except torch.cuda.OutOfMemoryError:
                out_of_memory = True
        oom_anywhere, stop = ctx.any_true(out_of_memory, stop_requested() and not last)
        if oom_anywhere or stop:
            model.zero_grad(set_to_none=True)
            return StepOutcome(completed=False, out_of_memory=oom_anywhere, stopped=stop and not oom_anywhere)
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
