"""One optimizer step's forward/backward passes with gradient accumulation.

Each micro-batch's loss is the mean token loss of its samples divided by the accumulation steps, and
the gradient reduction averages over ranks, so the accumulated gradient is the gradient of the mean loss
over the global batch whatever the split (world x accumulation x micro).

No pass waits for the device: losses and noise-scale terms stay on it (`StepOutcome` holds tensors) and
the loop reads them once per optimizer step, with the ranks' stop and checkpoint flags (eager.py).

- DDP synchronises only on the last micro-batch (`no_sync` on the others). Out of memory (CUDA): a rank
  that runs out skips its remaining passes (they have no collectives under `no_sync`), and before the
  last, synchronising backward all ranks agree whether any ran out (the step's one extra agreement
  under ddp); if so, every rank drops the step's partial gradients and the trainer retries the same
  global batch with half the micro batch (loop.py). An OOM *inside* the last micro-batch's backward cannot be
  agreed on (the other ranks are already in its all-reduce): it raises `UnagreedOutOfMemory`, handled
  as under FSDP.
- FSDP reduce-scatters every micro-batch's gradients into the shards (no unsharded gradient is kept
  between passes). HSDP reduce-scatters within the node every pass and all-reduces across nodes on the
  last pass only (parallel.py). Their forward and backward passes are full of collectives (a block's
  parameters are all-gathered before it runs), so an OOM on one rank cannot be agreed on at all:
  `accumulate_sharded` raises `UnagreedOutOfMemory` and the trainer records the halved micro batch and
  ends the job, whose retry resumes from the last checkpoint with it (loop.py).

Gradient noise scale (McCandlish et al. 2018, appendix A) needs the squared norm of a small-batch and a
big-batch gradient (planning/noise.py decides which). DDP: each rank's own accumulated gradient (batch micro
x accumulation) before the all-reduce vs the global one. FSDP and HSDP whose shard groups hold several ranks:
each rank's own gradient of every pass (batch micro), read from FSDP2's reduce-scatter input
(`parallel.ReadingReduceScatter`) and averaged over the passes, at any accumulation. Otherwise (one
data-parallel rank, hsdp with one-rank shard groups): the first accumulation pass, over all ranks (fsdp:
micro x world, read from the shards after the first backward) or over the shard group's ranks (hsdp, read from
FSDP2's partial-reduce buffers before any cross-group reduction); it needs accumulation >= 2, or a step
split in two halves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from batchpilot.train.distributed import DistContext
from batchpilot.train.parallel import (
    Parallel,
    cosine_tensor,
    gradients,
    node_gradient_shards,
    set_cross_node_reduction,
    squared_norm_tensor,
)
from batchpilot.train.runtime import StepOutcome

# Testing hook: simulate a device on which micro-batches larger than this run out of memory (rank 0).
INJECT_OOM_ENV = "BATCHPILOT_INJECT_OOM_ABOVE_MICRO_BATCH"


class UnagreedOutOfMemory(Exception):
    """This rank ran out of memory where the other ranks cannot be told (inside FSDP's collectives)."""

    def __init__(self, micro_batch_size: int) -> None:
        super().__init__(f"out of memory at micro batch {micro_batch_size}")
        self.micro_batch_size = micro_batch_size


def install_oom_injection(model: nn.Module, ctx: DistContext) -> None:
    """Testing hook (INJECT_OOM_ENV): rank 0 raises a CUDA OOM inside forward for larger micro-batches.

    Installed before the model is wrapped, it fires after DDP's or FSDP's own pre-forward work (FSDP's
    root all-gather included), inside the forward as a real OOM would.
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


def _backward(loss: torch.Tensor, *, may_fail: bool, micro: int) -> bool:
    """Backpropagates; an OOM returns False where it can be agreed on, and raises UnagreedOutOfMemory inside
    the synchronising pass (the other ranks are in its all-reduce)."""
    try:
        loss.backward()
    except torch.cuda.OutOfMemoryError:
        if not may_fail:
            raise UnagreedOutOfMemory(micro) from None
        return False
    return True


def _abandon(model: nn.Module) -> StepOutcome:
    """Drops the partial gradients of an attempt that all ranks agreed to give up (out of memory)."""
    model.zero_grad(set_to_none=True)
    return StepOutcome(completed=False, out_of_memory=True)


def accumulate_gradients(
    *,
    model: nn.Module,
    parallel: Parallel,
    micro_batches: Sequence[torch.Tensor],
    ctx: DistContext,
    autocast: Callable[[], contextlib.AbstractContextManager],
    measure_noise: bool,
    measure_coherence: bool,
) -> StepOutcome:
    """Runs every micro-batch; under ddp agrees with all ranks on out-of-memory before the last backward."""
    if parallel.sharded:
        return accumulate_sharded(
            model=model,
            parallel=parallel,
            micro_batches=micro_batches,
            ctx=ctx,
            autocast=autocast,
            measure_noise=measure_noise,
            measure_coherence=measure_coherence,
        )
    wrapped, hook = parallel.wrapped, parallel.hook
    accumulation = len(micro_batches)
    micro = micro_batches[0].shape[0]
    total_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
    outcome = StepOutcome(completed=False)
    first: list[torch.Tensor] | None = None
    # Gradients stay rank-local until the last micro-batch's backward synchronises them.
    noise_from_first = measure_noise and accumulation > 1 and not ctx.distributed
    coherence_local = measure_coherence and (accumulation > 2 or (accumulation > 1 and not ctx.distributed))
    if hook is not None:
        hook.reset()
    out_of_memory, loss = False, None
    for index, batch in enumerate(micro_batches):
        # Every forward runs without arming DDP's reducer; the last micro-batch arms it only once all ranks
        # agree that their passes fit, so an abandoned attempt never leaves the reducer half-armed.
        with wrapped.no_sync() if ctx.distributed else contextlib.nullcontext():  # type: ignore[operator]
            loss = _forward(ctx, wrapped, batch, autocast)
        if loss is None or index == accumulation - 1:
            out_of_memory = loss is None
            break
        with wrapped.no_sync() if ctx.distributed else contextlib.nullcontext():  # type: ignore[operator]
            if not _backward(loss / accumulation, may_fail=True, micro=micro):
                out_of_memory = True
                break
        total_loss += loss.detach().double()
        if index == 0 and noise_from_first:  # the first micro-batch's mean gradient: batch `micro`
            outcome.small_sq_norm = squared_norm_tensor(gradients(model), group=None, scale=accumulation)
            outcome.small_batch = micro
        if index == 0 and coherence_local:
            first = [g.clone() for g in gradients(model)]  # one copy of the gradient
        if index == 1 and first is not None:
            outcome.coherence = cosine_tensor(
                first, [g - f for g, f in zip(gradients(model), first, strict=True)], group=None
            )
    if ctx.any_true(out_of_memory)[0]:  # a rank that ran out skipped its remaining passes
        return _abandon(model)
    assert loss is not None
    if ctx.distributed:
        _arm_gradient_sync(wrapped)
    _backward(loss / accumulation, may_fail=False, micro=micro)
    total_loss += loss.detach().double()
    if index == 1 and first is not None:  # accumulation 2 on one process: the second pass was the last
        outcome.coherence = cosine_tensor(
            first, [g - f for g, f in zip(gradients(model), first, strict=True)], group=None
        )
    outcome.completed = True
    outcome.loss = total_loss / accumulation
    if measure_noise and hook is not None and hook.sq_norm is not None:
        outcome.small_sq_norm, outcome.small_batch = hook.sq_norm, micro * accumulation
    return outcome


def accumulate_sharded(
    *,
    model: nn.Module,
    parallel: Parallel,
    micro_batches: Sequence[torch.Tensor],
    ctx: DistContext,
    autocast: Callable[[], contextlib.AbstractContextManager],
    measure_noise: bool,
    measure_coherence: bool,
) -> StepOutcome:
    """FSDP/HSDP: every micro-batch's backward reduces into the shards (within the node only before the
    last pass under hsdp); an OOM raises UnagreedOutOfMemory (see the module docstring)."""
    accumulation = len(micro_batches)
    micro = micro_batches[0].shape[0]
    hsdp = parallel.replicate_group is not None
    group = parallel.shard_group
    total_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
    outcome = StepOutcome(completed=False)
    first: list[torch.Tensor] | None = None
    local = parallel.local_norms if measure_noise else None
    if parallel.local_norms is not None:
        parallel.local_norms.start(active=local is not None)
    for index, batch in enumerate(micro_batches):
        last = index == accumulation - 1
        set_cross_node_reduction(parallel, enabled=last)
        try:
            loss = micro_batch_loss(model, batch.to(ctx.device, non_blocking=True), autocast())
            (loss / accumulation).backward()
        except torch.cuda.OutOfMemoryError:
            raise UnagreedOutOfMemory(micro) from None
        total_loss += loss.detach().double()
        # After the first and second of several passes: the gradient so far, over all ranks (fsdp), or over
        # the node's ranks before any cross-node all-reduce (hsdp: so its coherence needs accumulation >= 3).
        from_passes = (measure_noise and local is None) or measure_coherence
        if not from_passes or index > 1 or accumulation == 1 or (hsdp and last):
            continue
        grads = node_gradient_shards(model) if hsdp else gradients(model)
        if index == 0 and measure_noise and local is None:
            outcome.small_sq_norm = squared_norm_tensor(grads, group=group, scale=accumulation)
            outcome.small_batch = micro * parallel.shard_degree  # the shard group's (fsdp: every rank's)
        if index == 0 and measure_coherence:
            first = [g.clone() for g in grads]  # a sharded copy: 1/shard_degree of the model
        if index == 1 and first is not None:
            outcome.coherence = cosine_tensor(
                first, [g - f for g, f in zip(grads, first, strict=True)], group=group
            )
    outcome.completed = True
    outcome.loss = total_loss / accumulation
    if local is not None:
        # Each pass's input is this rank's gradient of loss / accumulation on its micro batch: scaled back and
        # averaged over the passes; times the tensor-parallel size, as the step's mean over every process
        # (`read_step`) then is the mean over the data-parallel ranks of their whole gradients' norms.
        read = local.sq_norm()
        assert read is not None, "fsdp read no reduce-scatter input: was the custom comm replaced?"
        outcome.small_sq_norm = read * accumulation * parallel.tensor_parallel_size
        outcome.small_batch = micro
        local.start(active=False)
    return outcome
