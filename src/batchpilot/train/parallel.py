"""How the model is spread over the ranks: DDP replicas, or FSDP2 shards on a 1-D or 2-D device mesh.

- `ddp`: a full fp32 replica per rank; gradients are all-reduced once per optimizer step (the local-norm
  hook records each rank's gradient norm for the noise scale, see step.py).
- `fsdp`: `fully_shard` on each unit of `shard_units` (the embeddings, every block of `model.blocks`, the
  final norm with the output head), then on the root, over one mesh dimension of all ranks: parameters,
  gradients and AdamW state are split `world_size` ways. Every micro-batch's backward reduce-scatters
  into the shards (as torchtitan does): keeping unsharded gradients until the last micro-batch would
  hold a whole fp32 gradient per device, which is what fsdp is chosen to avoid.
- `hsdp`: the same on a 2-D mesh `(dp_replicate, dp_shard)` = `(nodes / k, k x devices per node)`: sharded
  within a group of k nodes (`train.hsdp_shard_nodes`, 1 by default: a node), replicated across the groups,
  so per-device memory does not depend on the node count.
  Micro-batches before the last reduce-scatter within the node only (FSDP2 adds them up in its
  partial-reduce buffer); the last one's backward all-reduces across nodes (`set_requires_all_reduce`):
  one cross-node reduction per optimizer step whatever the accumulation.

On a single process every strategy is the bare model (nothing to shard or replicate). With bf16 on a
GPU, FSDP runs its mixed-precision policy (bf16 parameters and compute, fp32 gradient reductions, fp32
sharded master weights and optimizer state); DDP uses autocast over its fp32 replica.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # FSDP2's comm interface
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from batchpilot.errors import BatchpilotError
from batchpilot.train.distributed import DistContext
from batchpilot.train.tensor_parallel import apply_tensor_parallel

Strategy = Literal["ddp", "fsdp", "hsdp"]


@dataclass
class LocalNormHook:
    """DDP communication hook state: the squared norm of this rank's gradient before the all-reduce.

    Kept per parameter (float64) and added up in the model's parameter order: DDP regroups its buckets
    after the first iteration of a process, so a sum of per-bucket sums would differ in its last bits
    between the first step after a resume and the same step of an uninterrupted run.
    """

    world_size: int
    positions: dict[int, int]
    """id() of each parameter -> its position in `model.parameters()`."""
    per_parameter: dict[int, torch.Tensor] = field(default_factory=dict)

    def reset(self) -> None:
        self.per_parameter = {}

    @property
    def sq_norm(self) -> torch.Tensor | None:
        """The squared norm of this rank's last backward's gradient (None before any)."""
        if not self.per_parameter:
            return None
        return torch.stack([self.per_parameter[k] for k in sorted(self.per_parameter)]).sum()


def _allreduce_with_local_norm(state, bucket):
    """DDP's default mean all-reduce, recording the local squared norm of each parameter on the way.

    No annotations: DDP compares them with `dist.GradBucket` at run time, and postponed (string)
    annotations would fail that check.
    """
    buffer = bucket.buffer()
    for parameter, gradient in zip(bucket.parameters(), bucket.gradients(), strict=True):
        state.per_parameter[state.positions[id(parameter)]] = gradient.detach().double().pow(2).sum()
    buffer.div_(state.world_size)
    future = dist.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


class LocalGradientNorms:
    """fsdp/hsdp: the squared norm of this rank's own gradient of each pass, read from FSDP2's reduce-scatter
    input (`ReadingReduceScatter`) while `active`: each unit's flat gradient, before any reduction. The
    noise scale's small-batch gradient (planning/noise.py) with no extra pass and no collective of its own.
    """

    def __init__(self) -> None:
        self.active = False
        self._norms: list[torch.Tensor] = []

    def start(self, *, active: bool) -> None:
        """Forgets what was read; reads the next backwards' inputs when `active`."""
        self.active, self._norms = active, []

    def read(self, flat: torch.Tensor, counted: list[tuple[int, int]] | None, world_size: int) -> None:
        """Records the norm of one reduce-scatter input (`counted`: the column ranges of its
        `[world_size, shard]` view this rank counts; None: all of it)."""
        # in fp32 (a no-op view of fp32 gradients; a float64 norm would copy the whole flat gradient first)
        if counted is None:
            self._norms.append(torch.linalg.vector_norm(flat.float()).double())
            return
        rows = flat.float().view(world_size, -1)
        self._norms.extend(torch.linalg.vector_norm(rows[:, a:b]).double() for a, b in counted)

    def sq_norm(self) -> torch.Tensor | None:
        """The sum of the squared norms read since `start` (None: none was read)."""
        if not self._norms:
            return None
        return torch.stack(self._norms).pow(2).sum()


class ReadingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (as its default comm), reading the input's norm first
    (`FSDPModule.set_custom_reduce_scatter`).

    FSDP2 hands the comm its flat input after dividing it by a "predivide factor", which it uses only for
    reduce dtypes other than fp32 and bf16 or with a gradient divide factor set
    (`_get_gradient_divide_factors` in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): neither is
    used here, so the input is the rank's gradient as backward made it; another dtype is refused.
    """

    def __init__(self, norms: LocalGradientNorms, counted: list[tuple[int, int]] | None) -> None:
        self._norms, self._counted = norms, counted

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self._norms.active:
            assert input_tensor.dtype in (torch.float32, torch.bfloat16), (
                f"fsdp reduces {input_tensor.dtype} gradients: FSDP2 would pre-divide them"
            )
            self._norms.read(input_tensor, self._counted, dist.get_world_size(group))
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )  # what FSDP2's default comm calls (torch 2.9: this; 2.13: reduce_scatter_single, the same collective)


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: `_fsdp_param_groups` (newer torch, 2.13 here: several per unit
    possible), or the one `_fsdp_param_group` of earlier versions (the XLA environment's torch 2.9); internal
    names, read from each installed torch's sources."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def fsdp_units(model: nn.Module) -> list[tuple[FSDPModule, list[Any]]]:
    """Each FSDP unit of `model` once (the modules of one grouped unit share a state), with its parameter
    groups."""
    units: list[tuple[FSDPModule, list[Any]]] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                units.append((module, _param_groups(state)))
    return units


def counted_ranges(group: Any) -> list[tuple[int, int]] | None:
    """Under tensor parallelism, the ranges of a parameter group's flat shard (one padded shard after another,
    as `foreach_reduce` lays them out) that this rank counts: a parameter replicated over the tensor-parallel
    group on the group's first rank only (as `gradients` counts it). None without tensor parallelism: all."""
    if not any(_on_tp_mesh(p.sharded_param) for p in group.fsdp_params):
        return None
    ranges, offset = [], 0
    for fsdp_param in group.fsdp_params:
        numel = fsdp_param.padded_sharded_param_size.numel()
        if _counted_here(fsdp_param.sharded_param):
            ranges.append((offset, offset + numel))
        offset += numel
    return ranges


def read_local_gradients(model: nn.Module) -> LocalGradientNorms:
    """Installs `ReadingReduceScatter` on every FSDP unit of `model` (one comm per unit's parameter group),
    counting what `counted_ranges` counts."""
    norms = LocalGradientNorms()
    for module, groups in fsdp_units(model):
        if groups:
            (group,) = groups
            module.set_custom_reduce_scatter(ReadingReduceScatter(norms, counted_ranges(group)))
    return norms


@dataclass
class Parallel:
    """The model as the loop runs it.

    Attributes:
        strategy: what was asked (`ddp`, `fsdp`, `hsdp`).
        wrapped: the module whose forward the loop calls (DDP wrapper, or the model itself).
        hook: DDP's local-norm hook (None otherwise).
        sharded: the gradients are FSDP shards (DTensors) reduced after every backward.
        shard_degree: data-parallel ranks one parameter is sharded over (1: replicas).
        mixed_precision: bf16 parameters and compute under FSDP's policy (autocast is then not used).
        shard_group: the ranks one parameter's shards are spread over (fsdp: all; hsdp: the shard group's),
            with their tensor-parallel peers: over it sums of per-part quantities add up to the whole
            gradient's.
        replicate_group: hsdp only: this rank and its peers on the other nodes (the cross-node all-reduce).
        tensor_parallel_size: ranks of a node that split each block (1: none).
        local_norms: fsdp/hsdp whose shard groups hold several data-parallel ranks: each rank's own gradient
            norms, read from the reduce-scatters (None otherwise).
    """

    strategy: Strategy
    wrapped: nn.Module
    hook: LocalNormHook | None
    sharded: bool
    shard_degree: int
    mixed_precision: bool
    shard_group: dist.ProcessGroup | None = None
    replicate_group: dist.ProcessGroup | None = None
    tensor_parallel_size: int = 1
    local_norms: LocalGradientNorms | None = None

    def describe(self) -> str:
        if self.sharded:
            precision = "bf16 compute, fp32 reductions" if self.mixed_precision else "fp32"
            split = (
                f", each block split {self.tensor_parallel_size} ways (tensor parallel)"
                if self.tensor_parallel_size > 1
                else ""
            )
            return f"{self.strategy}: parameters sharded {self.shard_degree} ways{split} ({precision})"
        return f"{self.strategy}: full replicas"


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one at a time: `model.blocks` (a ModuleList), else none."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def shard_units(model: nn.Module) -> list[list[nn.Module]]:
    """The FSDP units in forward order, the root left out (it takes what no unit holds).

    A model with `outer_modules()` (both built-in ones) gets its embeddings as one unit and its final norm
    with the output head as another, as torchtitan shards them, so neither is gathered for the whole
    forward and backward with the root. When the two sides share a parameter (tied embedding and head)
    they are one unit: FSDP2 manages a parameter in one unit only. Without `outer_modules` the units are
    the blocks alone; without blocks, none (the root is then the only unit).
    """
    blocks = [[block] for block in model_blocks(model)]
    outer = getattr(model, "outer_modules", None)
    if outer is None:
        return blocks
    first, last = outer()
    first_ids = {id(p) for module in first for p in module.parameters()}
    if any(id(p) in first_ids for module in last for p in module.parameters()):
        return [[*first, *last], *blocks]
    return [list(first), *blocks, list(last)]


def wrap_model(
    model: nn.Module,
    ctx: DistContext,
    *,
    strategy: Strategy,
    bf16: bool,
    materialize: Callable[[nn.Module], None],
    shard_nodes: int = 1,
    tensor_parallel_size: int = 1,
) -> Parallel:
    """Spreads the meta-device `model` over the ranks (see the module docstring); `materialize` gives this
    rank's part memory on `ctx.device` and fills it: after `fully_shard` (each rank holds its shards only), or
    before DDP (a whole replica). With `tensor_parallel_size` t > 1 each group of t consecutive ranks (on one
    node) splits every block (tensor_parallel.py) and FSDP2 shards over the other dimension of the mesh."""
    if not ctx.distributed:
        materialize(model)
        return Parallel(strategy, model, None, sharded=False, shard_degree=1, mixed_precision=False)
    tp = tensor_parallel_size
    if strategy == "ddp":
        assert tp == 1, "ddp with tensor parallelism is refused at plan time"
        materialize(model)
        positions = {id(parameter): k for k, parameter in enumerate(model.parameters())}
        hook = LocalNormHook(world_size=ctx.world_size, positions=positions)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        ddp.register_comm_hook(hook, _allreduce_with_local_norm)
        return Parallel(strategy, ddp, hook, sharded=False, shard_degree=1, mixed_precision=False)
    mesh, names = _mesh(ctx, strategy=strategy, shard_nodes=shard_nodes, tensor_parallel_size=tp)
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    data_mesh = mesh[names]
    replicate_group = mesh["dp_replicate"].get_group() if strategy == "hsdp" else None
    # The ranks whose parts of one replica's gradient add up to it: the shard group, with its tensor-parallel
    # peers (`gradients` counts a tensor-parallel replica once).
    group = mesh["dp_shard"].get_group() if tp == 1 else mesh["dp_shard", "tp"]._flatten().get_group()
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    units = shard_units(model)
    outer = getattr(model, "outer_modules", None)
    head = outer()[1][-1] if outer is not None else None
    for index, unit in enumerate(units):
        # The unit that runs last in the forward (the output head, tied or not) runs first in the backward:
        # keeping it gathered in between saves an all-gather (torchtitan's default for it).
        runs_last = index == len(units) - 1 or any(module is head for module in unit)
        fully_shard(
            unit if len(unit) > 1 else unit[0],
            mesh=data_mesh,
            mp_policy=policy,
            reshard_after_forward=not runs_last,
        )
    fully_shard(model, mesh=data_mesh, mp_policy=policy)
    materialize(model)
    degree = mesh["dp_shard"].size()
    return Parallel(
        strategy, model, None, sharded=True, shard_degree=degree, mixed_precision=bf16,
        shard_group=group, replicate_group=replicate_group, tensor_parallel_size=tp,
        local_norms=read_local_gradients(model) if degree > 1 else None,
    )  # fmt: skip


def _mesh(
    ctx: DistContext, *, strategy: Strategy, shard_nodes: int, tensor_parallel_size: int
) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The device mesh of fsdp `(dp_shard[, tp])` or hsdp `(dp_replicate, dp_shard[, tp])`, and the names of
    its data-parallel dimensions. Ranks are node-major and a tensor-parallel group is t consecutive ranks of
    one node; an hsdp shard group is `shard_nodes` whole nodes."""
    tp = tensor_parallel_size
    if ctx.local_world_size % tp:
        raise BatchpilotError(
            "train.tensor_parallel_size",
            f"is {tp}, but this node runs {ctx.local_world_size} process(es): a tensor-parallel group is "
            "processes of one node",
            "launch a multiple of train.tensor_parallel_size processes per node",
        )
    if strategy == "hsdp":
        group_size = shard_nodes * ctx.local_world_size
        if ctx.world_size % group_size:
            raise BatchpilotError(
                "train.parallelism",
                f"hsdp needs whole shard groups: world {ctx.world_size} is not a multiple of {shard_nodes} "
                f"node(s) x {ctx.local_world_size} processes",
                "launch every node with the same number of processes, on a multiple of train.hsdp_shard_nodes",
            )
        shape: tuple[int, ...] = (ctx.world_size // group_size, group_size // tp)
        names: tuple[str, ...] = ("dp_replicate", "dp_shard")
    else:
        shape, names = (ctx.world_size // tp,), ("dp_shard",)
    if tp > 1:
        return init_device_mesh(ctx.device.type, (*shape, tp), mesh_dim_names=(*names, "tp")), names
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names), names


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradients: whole tensors, or its local part of each FSDP shard. A parameter whole on every
    rank of a tensor-parallel group (a norm's scale) is counted on the group's first rank only, so that sums
    over the shard group (`Parallel.shard_group`) count it once."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None and _counted_here(p.grad)]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def _on_tp_mesh(tensor: torch.Tensor) -> bool:
    """A DTensor on a mesh with a tensor-parallel (`tp`) dimension."""
    return isinstance(tensor, DTensor) and "tp" in (tensor.device_mesh.mesh_dim_names or ())


def _counted_here(tensor: torch.Tensor) -> bool:
    """False for a DTensor replicated over the `tp` dimension of its mesh on a rank other than that group's
    first; True otherwise."""
    if not _on_tp_mesh(tensor):
        return True
    assert isinstance(tensor, DTensor)
    dim = (tensor.device_mesh.mesh_dim_names or ()).index("tp")
    return not (
        isinstance(tensor.placements[dim], Replicate) and tensor.device_mesh.get_local_rank("tp") != 0
    )


def _sum_over(total: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`total` added up over `group` (None: this rank's alone), on the device: no host synchronisation."""
    if group is not None:
        dist.all_reduce(total, group=group)
    return total


def squared_norm_tensor(
    grads: list[torch.Tensor], *, group: dist.ProcessGroup | None, scale: float = 1.0
) -> torch.Tensor:
    """The squared L2 norm of the gradient `scale x grads` as a float64 device scalar: this rank's tensors
    (or shards), summed over `group` when they are shards (one small all-reduce; shards of one replica do
    not overlap)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)  # nothing to measure: no device to wait for either
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.stack([n.double() for n in norms]).pow(2).sum() * scale**2
    return _sum_over(total, group)


def squared_norm(grads: list[torch.Tensor], *, group: dist.ProcessGroup | None, scale: float = 1.0) -> float:
    """`squared_norm_tensor` as a number (one host synchronisation)."""
    return float(squared_norm_tensor(grads, group=group, scale=scale))


def dot(a: list[torch.Tensor], b: list[torch.Tensor], *, group: dist.ProcessGroup | None) -> float:
    """The inner product of two gradients laid out alike (summed over `group` for shards)."""
    total = torch.stack([(x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)]).sum()
    return float(_sum_over(total, group))


def cosine_tensor(
    a: list[torch.Tensor], b: list[torch.Tensor], *, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The cosine between two gradients laid out alike as a float64 device scalar (NaN when one is zero):
    both squared norms and the inner product in one all-reduce over `group`."""
    terms = torch.stack(
        [
            torch.stack([n.double() for n in torch._foreach_norm(a, 2.0)]).pow(2).sum(),
            torch.stack([n.double() for n in torch._foreach_norm(b, 2.0)]).pow(2).sum(),
            torch.stack([(x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)]).sum(),
        ]
    )
    sq_a, sq_b, inner = _sum_over(terms, group).unbind()
    norms = sq_a * sq_b
    return torch.where(norms > 0, inner / norms.clamp_min(torch.finfo(torch.float64).tiny).sqrt(), torch.nan)


def node_gradient_shards(model: nn.Module) -> list[torch.Tensor]:
    """hsdp between accumulation passes: this rank's shard of its node's gradient so far.

    With `set_requires_all_reduce(False)` FSDP2 adds each pass's reduce-scatter output (the node's mean)
    into one flat buffer per unit and assigns no `.grad` until the cross-node all-reduce of the last pass;
    these are those buffers (their padding is zeros, so norms and inner products are the gradient's).
    `_partial_reduce_output` is FSDP2's internal name (read from the installed torch's sources); a torch without
    it fails here (tests/integration/test_train_hsdp.py checks the values against a one-process reference).
    """
    buffers: list[torch.Tensor] = []
    for _, groups in fsdp_units(model):
        for group in groups:
            partial = group._partial_reduce_output
            if partial is None:
                continue
            ranges = counted_ranges(group)
            buffers.extend([partial] if ranges is None else [partial[a:b] for a, b in ranges])
    assert buffers, (
        "no partial-reduce buffers: call between hsdp passes run with set_requires_all_reduce(False)"
    )
    return buffers


def set_cross_node_reduction(parallel: Parallel, *, enabled: bool) -> None:
    """hsdp: whether the next backward all-reduces across nodes (only the last micro-batch's does); a no-op
    for the other strategies (fsdp reduce-scatters over all ranks every pass, ddp uses no_sync)."""
    if parallel.replicate_group is not None:
        assert isinstance(parallel.wrapped, FSDPModule)
        parallel.wrapped.set_requires_all_reduce(enabled)
