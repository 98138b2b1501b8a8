"""Per-device memory of one training step, by parallelism strategy (ddp, fsdp, hsdp), in bytes.

The plan checks every stage's estimate against the device's memory and picks the strategy
(`train.parallelism: auto` takes the first of ddp, hsdp, fsdp that fits every stage). The accounting
follows what PyTorch allocates for the trainer (AdamW, bf16 autocast on CUDA, fp32 on CPU); N is the
number of parameters, "shard" the shard degree (1 for ddp, the world for fsdp, a node for hsdp).

Model state (the ZeRO paper's accounting, Rajbhandari et al. 2020, section 3.1: fp32 master weights and
Adam's two fp32 moments take 12 bytes per parameter in mixed precision):
- ddp (DistributedDataParallel over fp32 parameters; autocast casts to bf16 per op): parameters 4N,
  gradients 8N (the fp32 `.grad`s plus DDP's all-reduce buckets, a second copy because
  `gradient_as_bucket_view` is off; see the DDP docs), AdamW's exp_avg and exp_avg_sq 8N. Working set:
  with mixed precision, autocast's bf16 copies of the weights, 2N. They are not transient: autocast
  caches each cast for the rest of the forward (`torch.autocast(cache_enabled=True)`) and the matrix
  multiplies save the bf16 weight for their backward, so all of them live until the backward reaches
  them (counted whole, an upper bound with activation checkpointing, which frees them block by block).
- fsdp/hsdp (FSDP2 `fully_shard` on the embeddings, on every block and on the final norm with the output
  head, then on the root, as train/parallel.py's `shard_units`; `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)` with mixed precision): fp32 parameters 4N/shard, fp32 gradients 4N/shard, AdamW state
  8N/shard (FSDP2 docs: parameters are DTensors sharded on dim 0, the optimizer steps on the shards).
  Working set, in the param dtype (2 bytes mixed, else 4): two blocks' all-gathered parameters (the block
  running and the one prefetched) plus, at the peak of the phases of the backward, the unsharded buffers of
  the outer units: the head unit (kept gathered from its forward to its backward) with its gradient at the
  backward's start, a block's gradient in the middle, the embeddings and their gradient at the end. A tied
  embedding and head are one unit, gathered from the forward's start to the backward's end, and its
  gradient waits unsharded for the reduce-scatter until its whole backward is done, the end: both count
  through the backward. A model with no blocks is one unit: all of it unsharded, with its gradients.

Activations: planning/activations.py (the tensors each block saves, the loss's bytes per logit, explore's
measured slope).

Tensor parallelism (`tensor_parallel_size` t, train/tensor_parallel.py): each device holds 1/t of every
matrix and whole norms (their scales: `ModelShape.replicated_params`; the GPT's plan keeps its fused QKV
projection, biases and position embedding whole too), sharded further over the data-parallel ranks of its
shard group; FSDP gathers each unit's part (`ModelShape.tensor_parallel_part`). Of a block's activations the norms' saved tensors
(sequence-parallel: 1/t of the sequence), Q K V, the attention's output and log-sum-exps (1/t of the heads)
and the MLP's inner tensors (1/t of its width) are split; the projections' inputs, gathered whole from the
sequence's parts, are not (one tensor per norm, shared by its column-parallel projections). Between blocks
the residual stream is 1/t of the sequence; the logits are gathered whole. A test sums what autograd saves
on each rank of a group of 2 and finds this exactly (tests/integration/test_tensor_parallel_units.py). Its
communicator adds one NCCL communicator.

FSDP2's reduce-scatter input: each unit's gradient is copied, in the reduce dtype (fp32), into one flat
buffer that the reduce-scatter reads (`foreach_reduce` in torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py), so while a unit's gradient is reduced the working set holds it twice: in the param
dtype and in fp32 (4 bytes per parameter; under bf16 parameters that is twice the gradient itself).

NCCL's buffers, on a GPU with more than one device in the job: NCCL keeps a send and a receive buffer of
NCCL_BUFFSIZE (4 MiB by default, NCCL's environment variable reference) per channel (at most 32) for each
peer a ring or tree connects, in every communicator the trainer uses: 2 x 32 x 4 MiB = 256 MiB per
communicator, an upper bound (NCCL opens fewer channels on smaller topologies). The trainer's
communicators: ddp and fsdp one (the world), hsdp three (the world, the shard group, the replicate group).

Reserve: 1 GiB (the CUDA context and cuBLAS workspaces, which the caching allocator does not report) plus
5% of everything else (the allocator's fragmentation, which grows with what is allocated). Pass
`reserve_fixed_bytes=0` where there is no CUDA context (CPU, gloo: no NCCL buffers either). The start-up
needs nothing beyond this: the trainer builds the model on the meta device and gives each device only its
shards (models/deferred.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from batchpilot.errors import BatchpilotError
from batchpilot.planning.activations import activation_bytes_per_token
from batchpilot.planning.model_shape import ModelShape
from batchpilot.planning.stages import Stage

Strategy = Literal["ddp", "fsdp", "hsdp"]
RequestedStrategy = Literal["auto", "ddp", "fsdp", "hsdp"]
ActivationsSource = Literal["explore", "estimate"]

AUTO_ORDER: tuple[Strategy, ...] = ("ddp", "hsdp", "fsdp")
"""The order `auto` tries: least communication first."""

GIB = 2**30
RESERVE_FIXED_BYTES = GIB
"""The fixed part of the reserve: the CUDA context and cuBLAS workspaces."""
NCCL_BUFFER_BYTES = 4 * 2**20
"""NCCL_BUFFSIZE's default (NCCL's environment variable reference): one channel's buffer to one peer."""
NCCL_MAX_CHANNELS = 32
"""The most channels NCCL opens per communicator (its MAXCHANNELS)."""
COMMUNICATORS: dict[str, int] = {"ddp": 1, "fsdp": 1, "hsdp": 3}
"""NCCL communicators a trainer process uses, by strategy (module docstring)."""
RESERVE_FRACTION = 0.05
"""The proportional part of the reserve: the caching allocator's fragmentation."""


@dataclass(frozen=True)
class MemoryEstimate:
    """One device's memory at the peak of a training step, in bytes, by what holds it.

    Attributes:
        strategy: the parallelism the estimate is for.
        shard_degree: devices the model state is sharded over (1: replicated).
        parameters: the (sharded) fp32 parameters.
        gradients: the (sharded) fp32 gradients, plus DDP's all-reduce buckets under ddp.
        optimizer: AdamW's two moments (sharded).
        unsharded_working_set: FSDP's all-gathered parameters and unsharded gradients in flight, or
            autocast's bf16 weight copies under ddp.
        activations: what the forward pass keeps for the backward, logits and loss included.
        reserve: CUDA context and allocator fragmentation.
        activations_source: "explore" (measured slope) or "estimate" (analytic).
        communication: NCCL's buffers (0 on the CPU or a job of one device).
    """

    strategy: Strategy
    shard_degree: int
    parameters: int
    gradients: int
    optimizer: int
    unsharded_working_set: int
    activations: int
    reserve: int
    activations_source: ActivationsSource
    communication: int = 0
    tensor_parallel_size: int = 1
    """Devices of a node that split each block (each also holds 1/shard_degree of its part)."""

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.unsharded_working_set
            + self.activations
            + self.communication
            + self.reserve
        )

    def describe(self) -> str:
        """One line in GiB (MiB below 1 GiB): `31.2 GiB = params 1.2 + grads 1.2 + ... + reserve 0.7`."""
        unit, size = ("GiB", GIB) if self.total >= GIB else ("MiB", 2**20)
        parts = (
            f"params {self.parameters / size:.1f} + grads {self.gradients / size:.1f}"
            f" + optimizer {self.optimizer / size:.1f} + working set {self.unsharded_working_set / size:.1f}"
            f" + activations {self.activations / size:.1f} ({self.activations_source})"
            + (f" + NCCL {self.communication / size:.1f}" if self.communication else "")
            + f" + reserve {self.reserve / size:.1f}"
        )
        return f"{self.total / size:.1f} {unit} = {parts}"

    def to_dict(self) -> dict[str, Any]:
        """Plain ints and strings for plan.json; byte counts end in `_bytes`."""
        return {
            "strategy": self.strategy,
            "shard_degree": self.shard_degree,
            "parameters_bytes": self.parameters,
            "gradients_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "unsharded_working_set_bytes": self.unsharded_working_set,
            "activations_bytes": self.activations,
            "reserve_bytes": self.reserve,
            "communication_bytes": self.communication,
            "total_bytes": self.total,
            "activations_source": self.activations_source,
            **({"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size > 1 else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryEstimate:
        fields = {key.removesuffix("_bytes"): value for key, value in data.items() if key != "total_bytes"}
        return cls(**fields)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


def shard_degree(strategy: Strategy, *, world_size: int, devices_per_node: int, shard_nodes: int = 1) -> int:
    """Devices one copy of the model state is sharded over: ddp 1, fsdp the world, hsdp the `shard_nodes`
    nodes of a shard group."""
    if strategy == "ddp":
        return 1
    if strategy == "fsdp":
        return world_size
    return min(shard_nodes * devices_per_node, world_size)


def shard_node_choices(stages: Sequence[Stage]) -> list[int]:
    """hsdp's possible shard groups, in nodes: those dividing every stage's node count (each stage's nodes
    split into whole groups), fewest first."""
    common = math.gcd(*(stage.num_nodes for stage in stages)) if stages else 1
    return [k for k in range(1, common + 1) if common % k == 0]


def estimate_memory(
    *,
    shape: ModelShape,
    strategy: Strategy,
    world_size: int,
    devices_per_node: int,
    micro_batch_size: int,
    seq_len: int,
    mixed_precision: bool,
    activation_checkpointing: bool,
    activation_bytes_per_sample: float | None = None,
    reserve_fixed_bytes: int = RESERVE_FIXED_BYTES,
    shard_nodes: int = 1,
    tensor_parallel_size: int = 1,
) -> MemoryEstimate:
    """Per-device memory of one training step (the accounting is in the module docstring).

    Args:
        world_size: devices of the stage (tensor-parallel ones included).
        shard_nodes: hsdp: the nodes one shard group spans.
        tensor_parallel_size: devices of a node that split each block (fsdp or hsdp over the rest).
        activation_bytes_per_sample: explore's measured slope for this activation checkpointing
            setting; None estimates activations from the shape.
        reserve_fixed_bytes: the reserve's fixed part; 0 where there is no CUDA context (CPU).
    """
    tp = tensor_parallel_size
    degree = shard_degree(
        strategy,
        world_size=world_size // tp,
        devices_per_node=devices_per_node // tp,
        shard_nodes=shard_nodes,
    )
    # Per device before data-parallel sharding: its tensor-parallel part of the matrices, the norms whole.
    n = (
        shape.num_params
        if tp == 1
        else (shape.num_params - shape.replicated_params) / tp + shape.replicated_params
    )
    if strategy == "ddp":
        parameters, gradients, optimizer = 4 * shape.num_params, 8 * shape.num_params, 8 * shape.num_params
        working_set = 2 * shape.num_params if mixed_precision else 0
    else:
        parameters, gradients, optimizer = (math.ceil(b * n / degree) for b in (4, 4, 8))
        # the gathered units are this device's tensor-parallel parts (the whole parameters whole)
        part = shape.tensor_parallel_part(tp)
        working_set = _fsdp_working_set(part, param_bytes=2 if mixed_precision else 4)
    source: ActivationsSource
    if activation_bytes_per_sample is not None:
        activations, source = round(activation_bytes_per_sample * micro_batch_size), "explore"
    else:
        activations = (
            micro_batch_size
            * seq_len
            * activation_bytes_per_token(
                shape,
                mixed_precision=mixed_precision,
                activation_checkpointing=activation_checkpointing,
                residual_bytes=4 if strategy == "ddp" or not mixed_precision else 2,
                autocast=mixed_precision and strategy == "ddp",
                tensor_parallel_size=tp,
            )
        )
        source = "estimate"
    gpu_job = reserve_fixed_bytes > 0 and world_size > 1
    communicators = COMMUNICATORS[strategy] + (1 if tp > 1 else 0)  # the tensor-parallel group's
    communication = communicators * 2 * NCCL_MAX_CHANNELS * NCCL_BUFFER_BYTES if gpu_job else 0
    subtotal = parameters + gradients + optimizer + working_set + activations + communication
    return MemoryEstimate(
        strategy=strategy,
        shard_degree=degree,
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        unsharded_working_set=working_set,
        activations=activations,
        reserve=reserve_fixed_bytes + math.ceil(RESERVE_FRACTION * subtotal),
        activations_source=source,
        communication=communication,
        tensor_parallel_size=tp,
    )


def _fsdp_working_set(shape: ModelShape, *, param_bytes: int) -> int:
    """FSDP2's unsharded parameters and gradients at the peak, in the param dtype, with the fp32
    reduce-scatter input of the gradient being reduced (module docstring)."""
    gathered, reducing = (
        param_bytes,
        param_bytes + REDUCE_BYTES,
    )  # per parameter: gathered; its gradient's two
    if shape.num_layers == 0:
        return shape.num_params * (gathered + reducing)
    block = shape.largest_block_params
    outer = max(shape.num_params - shape.num_layers * block, 0)
    embedding = shape.vocab_size * shape.hidden_size
    gathered_blocks = min(2, shape.num_layers) * block * gathered
    if outer < 2 * embedding:
        # One outer unit (a tied embedding and head): gathered from the forward's start to the backward's end,
        # and its gradient, reduce-scattered once its whole backward is done, unsharded through the backward.
        return outer * (gathered + reducing) + gathered_blocks + block * reducing
    head = outer - embedding  # the final norm and the output head
    peaks = (
        head * (gathered + reducing) + gathered_blocks,  # backward's start: the head unit, its gradient
        gathered_blocks + block * reducing,  # a block's backward: two blocks gathered, one's gradient
        embedding * (gathered + reducing) + block * (gathered + param_bytes),  # the end: the embeddings
    )
    return max(peaks)


REDUCE_BYTES = 4
"""Bytes per parameter of FSDP2's reduce-scatter input: the gradient copied in the reduce dtype, fp32."""


@dataclass(frozen=True)
class StageMemory:
    """A stage's name and its per-device estimate."""

    stage: str
    estimate: MemoryEstimate


@dataclass(frozen=True)
class MemoryPlan:
    """The chosen strategy and its per-device estimate for every stage of the plan.

    Attributes:
        strategy: the parallelism the trainer uses.
        stages: one estimate per stage, in the plan's order.
        device_memory_bytes: what the estimates were checked against; None when unknown (not checked).
    """

    strategy: Strategy
    stages: tuple[StageMemory, ...]
    device_memory_bytes: int | None
    shard_nodes: int = 1
    """hsdp: the nodes one shard group spans (1 otherwise)."""

    @property
    def peak(self) -> StageMemory:
        """The stage that needs the most memory (the first of equals)."""
        return _peak(self.stages)

    @property
    def fits(self) -> bool | None:
        """Whether every stage fits the device; None when its memory is unknown."""
        if self.device_memory_bytes is None:
            return None
        return self.peak.estimate.total <= self.device_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain ints, strings and booleans for plan.json."""
        return {
            "strategy": self.strategy,
            **({"hsdp_shard_nodes": self.shard_nodes} if self.shard_nodes > 1 else {}),
            "device_memory_bytes": self.device_memory_bytes,
            "fits": self.fits,
            "peak_stage": self.peak.stage,
            "stages": [{"stage": item.stage, **item.estimate.to_dict()} for item in self.stages],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryPlan:
        stages = tuple(
            StageMemory(
                item["stage"], MemoryEstimate.from_dict({k: v for k, v in item.items() if k != "stage"})
            )
            for item in data["stages"]
        )
        return cls(
            strategy=data["strategy"],
            stages=stages,
            device_memory_bytes=data["device_memory_bytes"],
            shard_nodes=data.get("hsdp_shard_nodes", 1),
        )


def _peak(stages: Sequence[StageMemory]) -> StageMemory:
    if not stages:
        raise ValueError("a memory plan needs at least one stage")
    return max(stages, key=lambda item: item.estimate.total)


def tensor_parallel_problem(
    shape: ModelShape, *, tensor_parallel_size: int, factory: str
) -> BatchpilotError | None:
    """What the model's shape must allow for `train.tensor_parallel_size` (None: it does): a tensor-parallel
    plan for its kind, and heads, key/value heads, MLP width and vocabulary that split evenly (each device
    takes whole heads; FSDP2 shards each device's part further, which needs the parts equal)."""
    t = tensor_parallel_size
    if t == 1:
        return None
    if not shape.tensor_parallel:
        return BatchpilotError(
            "train.tensor_parallel_size",
            f"is {t}, but the trainer has no tensor-parallel plan for {factory} (plans exist for "
            "batchpilot.models.llama:build and batchpilot.models.gpt:build)",
            "use one of those models, or train.tensor_parallel_size: 1 with fsdp or hsdp",
        )
    sizes = {
        "n_head": shape.num_heads,
        "n_kv_head": shape.num_kv_heads,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "vocab_size": shape.vocab_size,
    }
    uneven = [f"{name} {value}" for name, value in sizes.items() if value % t]
    if uneven:
        return BatchpilotError(
            "train.tensor_parallel_size",
            f"is {t}, which does not divide the model's {', '.join(uneven)} (each device takes an equal part)",
            f"use a tensor_parallel_size that divides them, or change model.args to multiples of {t}",
        )
    return None


def check_shard_nodes(stages: Sequence[Stage], shard_nodes: int) -> None:
    """A configured hsdp shard group must split every stage's nodes into whole groups.

    Raises:
        BatchpilotError: naming the first stage it does not divide and the sizes that would.
    """
    wrong = next((stage for stage in stages if stage.num_nodes % shard_nodes), None)
    if wrong is not None:
        choices = ", ".join(str(k) for k in shard_node_choices(stages))
        raise BatchpilotError(
            "train.hsdp_shard_nodes",
            f"is {shard_nodes}, but {wrong.name} runs on {wrong.num_nodes} node(s), which do not split into groups "
            f"of {shard_nodes}",
            f"use one that divides every stage's node count ({choices}), or leave it unset",
        )


def plan_memory(
    *,
    requested: RequestedStrategy,
    shape: ModelShape,
    stages: Sequence[Stage],
    devices_per_node: int,
    seq_len: int,
    mixed_precision: bool,
    activation_checkpointing: bool,
    activation_bytes_per_sample: float | None,
    device_memory_bytes: int | None,
    reserve_fixed_bytes: int = RESERVE_FIXED_BYTES,
    shard_nodes: int | None = 1,
    tensor_parallel_size: int = 1,
) -> MemoryPlan:
    """Estimates every stage under each strategy and picks one (`choose_strategy`).

    Args:
        shard_nodes: hsdp's shard group in nodes (`train.hsdp_shard_nodes`); None: the fewest of
            `shard_node_choices` whose estimate fits every stage (the most, when none does).

    Raises:
        BatchpilotError: the requested strategy, or with `auto` every strategy, needs more memory
            than the device has at some stage.
    """

    def estimates_of(strategy: Strategy, nodes: int) -> tuple[StageMemory, ...]:
        return tuple(
            StageMemory(
                stage.name,
                estimate_memory(
                    shape=shape,
                    strategy=strategy,
                    world_size=stage.world_size,
                    devices_per_node=devices_per_node,
                    micro_batch_size=stage.micro_batch_size,
                    seq_len=seq_len,
                    mixed_precision=mixed_precision,
                    activation_checkpointing=activation_checkpointing,
                    activation_bytes_per_sample=activation_bytes_per_sample,
                    reserve_fixed_bytes=reserve_fixed_bytes,
                    shard_nodes=nodes,
                    tensor_parallel_size=tensor_parallel_size,
                ),
            )
            for stage in stages
        )

    if shard_nodes is not None:
        check_shard_nodes(stages, shard_nodes)
    else:  # the fewest nodes per shard group that fit: the least cross-node traffic
        choices = shard_node_choices(stages)
        fitting = [
            k
            for k in choices
            if device_memory_bytes is not None
            and _peak(estimates_of("hsdp", k)).estimate.total <= device_memory_bytes
        ]
        shard_nodes = fitting[0] if fitting else choices[-1] if device_memory_bytes is not None else 1
    # ddp does not take tensor-parallel parameters (plan/checks.py refuses it): auto chooses among the others.
    considered = AUTO_ORDER if tensor_parallel_size == 1 else tuple(s for s in AUTO_ORDER if s != "ddp")
    estimates = {
        strategy: estimates_of(strategy, shard_nodes if strategy == "hsdp" else 1) for strategy in considered
    }
    strategy = choose_strategy(
        requested=requested,
        estimates=estimates,
        device_memory_bytes=device_memory_bytes,
        activation_checkpointing=activation_checkpointing,
    )
    return MemoryPlan(
        strategy=strategy,
        stages=estimates[strategy],
        device_memory_bytes=device_memory_bytes,
        shard_nodes=shard_nodes if strategy == "hsdp" else 1,
    )


def choose_strategy(
    *,
    requested: RequestedStrategy,
    estimates: Mapping[Strategy, Sequence[StageMemory]],
    device_memory_bytes: int | None,
    activation_checkpointing: bool,
) -> Strategy:
    """`auto`: the first of ddp, hsdp, fsdp whose largest stage estimate fits; else the requested one.

    With the device memory unknown, `auto` is ddp and a requested strategy is taken unchecked.

    Args:
        estimates: per strategy, the estimate of every stage (strategies left out are not considered).
        activation_checkpointing: whether it is on (it is suggested when nothing fits and it is off).

    Raises:
        BatchpilotError: the chosen strategy does not fit, naming the stage where it peaks and what fits.
    """
    if requested != "auto" and requested not in get_args(Strategy):
        raise BatchpilotError(
            "train.parallelism", f"unknown strategy {requested!r}", "use auto, ddp, hsdp or fsdp"
        )
    if device_memory_bytes is None:
        return next(iter(estimates)) if requested == "auto" else requested  # the least communication
    peaks = {strategy: _peak(estimates[strategy]) for strategy in AUTO_ORDER if strategy in estimates}
    fitting = [strategy for strategy, peak in peaks.items() if peak.estimate.total <= device_memory_bytes]
    if requested == "auto" and fitting:
        return fitting[0]
    if requested in fitting:
        return requested
    device = f"more than the device's {_gib(device_memory_bytes)} GiB"
    if requested == "auto":
        smallest = min(peaks, key=lambda strategy: peaks[strategy].estimate.total)
        problem = f"no strategy fits: even {smallest} needs {peaks[smallest].estimate.describe()} per device at stage {peaks[smallest].stage}, {device}"
    else:
        peak = peaks[requested]
        problem = f"{requested} needs {peak.estimate.describe()} per device at stage {peak.stage}, {device}"
    if fitting:
        fix = "use " + " or ".join(f"{s} (peak {_gib(peaks[s].estimate.total)} GiB)" for s in fitting)
    else:
        checkpointing = "" if activation_checkpointing else "set train.activation_checkpointing: true, "
        fix = f"lower batch.micro_batch_size, {checkpointing}or use more devices (fsdp's share shrinks as the world grows)"
    raise BatchpilotError("train.parallelism", problem, fix)
