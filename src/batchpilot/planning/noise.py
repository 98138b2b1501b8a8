"""Where a step measures the gradient noise scale, and how: the rule the trainers follow and the planner
checks (pure: no torch).

The noise scale needs the squared norms of a small-batch and a big-batch gradient of the same step
(McCandlish et al. 2018). The big batch is the step's global batch. The small batch, in this order:
- several data-parallel ranks whose gradients pass through a reduction the trainer can read before it
  (McCandlish et al.'s own estimator: each rank's local gradient is a small-batch estimate): ddp's
  all-reduce (a communication hook: the rank's accumulated gradient, batch micro x accumulation), fsdp's and
  hsdp's reduce-scatter (its input: the rank's own gradient of each pass, batch micro, averaged over the
  passes and the ranks). Every step, at any micro batch and accumulation, with no extra pass: *local
  gradients*. hsdp whose shard group is one rank (one process per node, `train.hsdp_shard_nodes` 1) has no
  reduce-scatter to read, and the XLA runtime's SPMD program reduces inside the compiled step: neither reads
  local gradients;
- otherwise, the first accumulation pass, whose gradient is read before the later passes add to it: every
  step when the step has two passes or more;
- at accumulation 1 there is one pass, so a *measuring step* runs its micro-batch as two halves (the same
  samples on the same ranks, each half's loss weighted 1/2: the same gradient), every
  `train.measure_noise_every_steps` steps. That costs the step one more pass's collectives (fsdp: one more
  all-gather and reduce-scatter of the parameters), which is why it is not every step by default. A
  micro batch of odd size cannot be halved evenly: such a stage does not measure (the planner says so).
"""

from __future__ import annotations

from enum import Enum


class NoiseMeasurement(Enum):
    """How the steps of a stage measure the noise scale."""

    LOCAL_GRADIENTS = "every step, from each rank's own gradient"
    EVERY_STEP = "every step, from the first pass"
    SPLIT_STEPS = "split steps"
    NONE = "none"


def reads_local_gradients(*, strategy: str, world_size: int, shard_degree: int) -> bool:
    """Whether the data-parallel ranks' own gradients can be read before their reduction (see the module
    docstring).

    Args:
        strategy: ddp, fsdp, hsdp, or "xla" for the XLA runtime.
        world_size: data-parallel ranks.
        shard_degree: the ranks one parameter is sharded over (fsdp: every data-parallel rank; hsdp: a shard
            group's; ddp: 1).
    """
    if world_size < 2:
        return False
    if strategy == "ddp":
        return True
    return strategy in ("fsdp", "hsdp") and shard_degree > 1


def noise_measurement(
    *,
    strategy: str,
    world_size: int,
    micro_batch_size: int,
    accumulation: int,
    split_every_steps: int,
    shard_degree: int,
) -> NoiseMeasurement:
    """How a stage with this layout measures (see the module docstring).

    Args:
        strategy: the plan's parallelism (ddp, fsdp, hsdp) or "xla" for the XLA runtime.
        world_size: data-parallel ranks (eager processes, XLA devices).
        split_every_steps: `train.measure_noise_every_steps` (0: never split a step).
        shard_degree: see `reads_local_gradients`.
    """
    if reads_local_gradients(strategy=strategy, world_size=world_size, shard_degree=shard_degree):
        return NoiseMeasurement.LOCAL_GRADIENTS
    if accumulation >= 2:
        return NoiseMeasurement.EVERY_STEP
    if split_every_steps > 0 and micro_batch_size >= 2 and micro_batch_size % 2 == 0:
        return NoiseMeasurement.SPLIT_STEPS
    return NoiseMeasurement.NONE


def splits_step(measurement: NoiseMeasurement, *, step: int, split_every_steps: int) -> bool:
    """Whether optimizer step number `step` (1 for the first) runs its one micro-batch as two halves."""
    return measurement is NoiseMeasurement.SPLIT_STEPS and step % split_every_steps == 0


def why_unmeasured(*, micro_batch_size: int, split_every_steps: int) -> str:
    """The reason a stage at accumulation 1 does not measure, for one line of the plan's notes."""
    if split_every_steps == 0:
        return "train.measure_noise_every_steps is 0 (no step is split in two halves)"
    return f"its micro batch {micro_batch_size} cannot be split in two equal halves"
