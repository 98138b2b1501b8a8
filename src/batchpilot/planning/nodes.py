"""Node scheduling per ramp-up stage (NeMo launcher rule).

Walking down from the target batch, which may use up to `max_nodes`, each smaller batch `b` gets the
largest node count `n <= nodes(next larger batch)` (and `>= min_nodes`) such that
`b % (micro_batch_size x data_parallel_size(n)) == 0`. With loading hosts (an integer
`expansion_factor_real_data` f > 1) only node counts that f divides are candidates: the trainer makes
every f-th host a loading host and refuses a node count that f does not divide.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from batchpilot.errors import BatchpilotError


def data_parallel_size(
    *, num_nodes: int, devices_per_node: int, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1
) -> int | None:
    """devices / (pipeline x tensor parallel sizes), or None when that is not a whole number."""
    devices = num_nodes * devices_per_node
    model_parallel = pipeline_parallel_size * tensor_parallel_size
    return devices // model_parallel if devices % model_parallel == 0 else None


@dataclass(frozen=True)
class Placement:
    """Where a stage's batch may run: the node range and the rules every node count must meet.

    Attributes:
        devices_per_node: devices (processes under eager) per node.
        max_nodes, min_nodes: the node range (`cluster.max_nodes`, `cluster.min_nodes`).
        pipeline_parallel_size, tensor_parallel_size: devices one model replica spans.
        loading_factor: node counts must be multiples of it (loading hosts; 1: no rule).
        allowed_nodes: the only node counts allowed (a TPU type's slice host counts; None: any).
    """

    devices_per_node: int
    max_nodes: int
    min_nodes: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    loading_factor: int = 1
    allowed_nodes: frozenset[int] | None = None

    def data_parallel_size(self, num_nodes: int) -> int | None:
        """The data-parallel size on `num_nodes` nodes, or None when the model-parallel sizes do not divide it."""
        return data_parallel_size(
            num_nodes=num_nodes,
            devices_per_node=self.devices_per_node,
            pipeline_parallel_size=self.pipeline_parallel_size,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def allows(self, num_nodes: int) -> bool:
        """Whether a stage may run on `num_nodes`: a multiple of the loading factor, among `allowed_nodes`."""
        return num_nodes % self.loading_factor == 0 and (
            self.allowed_nodes is None or num_nodes in self.allowed_nodes
        )

    def fits(self, *, global_batch_size: int, num_nodes: int, micro_batch_size: int) -> bool:
        """Whether `global_batch_size` splits into whole micro-batches on `num_nodes` nodes, the loading
        hosts (one per `loading_factor` nodes) divide the node count, and the count is allowed."""
        dp = self.data_parallel_size(num_nodes)
        return dp is not None and self.allows(num_nodes) and global_batch_size % (micro_batch_size * dp) == 0

    def node_counts(self, *, up_to: int | None = None) -> list[int]:
        """The node counts a stage may run on, ascending: [min_nodes, up_to or max_nodes], allowed ones."""
        return node_counts(
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes if up_to is None else up_to,
            loading_factor=self.loading_factor,
            allowed_nodes=self.allowed_nodes,
        )

    def capped(self, max_nodes: int) -> Placement:
        """The same rules on at most `max_nodes` nodes."""
        return replace(self, max_nodes=max_nodes)


def node_counts(
    *, min_nodes: int, max_nodes: int, loading_factor: int = 1, allowed_nodes: Collection[int] | None = None
) -> list[int]:
    """The node counts a stage may run on, ascending: [min_nodes, max_nodes], multiples of the factor,
    and among `allowed_nodes` when given (a TPU type's slice host counts)."""
    return [
        n
        for n in range(min_nodes, max_nodes + 1)
        if n % loading_factor == 0 and (allowed_nodes is None or n in allowed_nodes)
    ]


def whole_loading_factor(expansion_factor: Fraction) -> int:
    """The loading factor node counts must be multiples of: a whole `expansion_factor` f > 1 (the trainer
    makes every f-th host a loading host), else 1, no rule (f <= 1 every host reads; a fractional f > 1 is
    refused by `num_loading_hosts`, as the trainer refuses it)."""
    return int(expansion_factor) if expansion_factor > 1 and expansion_factor.denominator == 1 else 1


def check_loading_factor(*, loading_factor: int, min_nodes: int, max_nodes: int) -> None:
    """Some node count in [min_nodes, max_nodes] must be a multiple of the (whole) loading factor."""
    if not node_counts(min_nodes=min_nodes, max_nodes=max_nodes, loading_factor=loading_factor):
        raise BatchpilotError(
            "data.expansion_factor_real_data",
            f"{loading_factor} divides no node count in [{min_nodes}, {max_nodes}] (cluster.min_nodes, "
            "max_nodes), and the trainer needs every node count to be a whole number of loading groups",
            f"use 1 or a factor that divides cluster.max_nodes ({max_nodes})",
        )


def nearest_valid_batch_sizes(
    global_batch_size: int,
    *,
    node_range: Sequence[int],
    micro_batch_size: int,
    devices_per_node: int,
    pp: int,
    tp: int,
) -> tuple[int | None, int | None]:
    """The closest global batch sizes below and above `global_batch_size` that some node count fits."""
    units = []
    for n in node_range:
        dp = data_parallel_size(
            num_nodes=n, devices_per_node=devices_per_node, pipeline_parallel_size=pp, tensor_parallel_size=tp
        )
        if dp is not None:
            units.append(micro_batch_size * dp)
    if not units:
        return None, None
    below = max((global_batch_size // u * u for u in units if global_batch_size // u > 0), default=None)
    above = min(-(-global_batch_size // u) * u for u in units)
    return below, above


def walk_nodes(
    *, batch_sizes: Sequence[int], micro_batch_size: int, placement: Placement
) -> list[int | None]:
    """The NeMo walk: node count per (ascending) batch size, None where no count in [min_nodes, cap] fits.

    A stage that does not fit leaves the cap where it was, so every stage after it is still judged.
    """
    assert list(batch_sizes) == sorted(batch_sizes), batch_sizes
    nodes: list[int | None] = [None] * len(batch_sizes)
    cap = placement.max_nodes
    for index in reversed(range(len(batch_sizes))):
        chosen = next(
            (
                n
                for n in range(cap, placement.min_nodes - 1, -1)
                if placement.fits(
                    global_batch_size=batch_sizes[index], num_nodes=n, micro_batch_size=micro_batch_size
                )
            ),
            None,
        )
        if chosen is not None:
            nodes[index] = cap = chosen
    return nodes


def unschedulable_stages(*, batch_sizes: Sequence[int], placement: Placement) -> list[int]:
    """Indexes of the stages that no micro batch can place on the cluster.

    Every micro batch is a multiple of 1, so a stage that micro batch 1 cannot split over any node count
    the walk allows cannot be split with any other micro batch either (a larger micro batch only removes
    node counts, and the walk's caps only shrink with it).
    """
    nodes = walk_nodes(batch_sizes=batch_sizes, micro_batch_size=1, placement=placement)
    return [index for index, n in enumerate(nodes) if n is None]


def schedule_nodes(*, batch_sizes: Sequence[int], micro_batch_size: int, placement: Placement) -> list[int]:
    """Node count for each (ascending) global batch size.

    Raises:
        BatchpilotError: one line naming the first stage (from the top) that cannot fit, every other
            stage that cannot, the nearest batch sizes that would and micro batch sizes that fit them all.
    """
    min_nodes, max_nodes, loading_factor = placement.min_nodes, placement.max_nodes, placement.loading_factor
    if min_nodes > max_nodes:
        raise BatchpilotError("cluster.min_nodes", f"{min_nodes} exceeds cluster.max_nodes {max_nodes}")
    check_loading_factor(loading_factor=loading_factor, min_nodes=min_nodes, max_nodes=max_nodes)

    def walk(micro: int) -> list[int | None]:
        return walk_nodes(batch_sizes=batch_sizes, micro_batch_size=micro, placement=placement)

    # A micro batch above every stage's batch, where micro batch 1 places every stage: the micro batch alone is
    # wrong, so it is named (a stage that micro batch 1 cannot place is the stage's problem, said below).
    if micro_batch_size > max(batch_sizes) and None not in walk(1):
        micros = _fitting_micro_batches(micro_batch_size, walk=walk, batch_sizes=batch_sizes)
        raise BatchpilotError(
            "batch.micro_batch_size",
            f"{micro_batch_size:,} samples per device is more than the largest stage's global batch "
            f"({max(batch_sizes):,})",
            f"use micro_batch_size {micros}"
            if micros
            else "use a micro batch that divides every stage's batch",
        )

    nodes = walk(micro_batch_size)
    failed = [index for index in reversed(range(len(nodes))) if nodes[index] is None]
    if not failed:
        return [n for n in nodes if n is not None]
    first = failed[0]
    cap = next((n for n in nodes[first + 1 :] if n is not None), max_nodes)
    below, above = nearest_valid_batch_sizes(
        batch_sizes[first],
        node_range=placement.node_counts(up_to=cap),
        micro_batch_size=micro_batch_size,
        devices_per_node=placement.devices_per_node,
        pp=placement.pipeline_parallel_size,
        tp=placement.tensor_parallel_size,
    )
    suggestions = " or ".join(str(b) for b in (below, above) if b is not None) or "none"
    others = ", ".join(f"{index} ({batch_sizes[index]})" for index in failed[1:])
    loading = f" divisible by the loading factor {loading_factor}" if loading_factor > 1 else ""
    if placement.allowed_nodes is not None:
        loading += f" among the slice host counts {sorted(placement.allowed_nodes)}"
    micros = _fitting_micro_batches(micro_batch_size, walk=walk, batch_sizes=batch_sizes)
    raise BatchpilotError(
        f"stage {first} (global_batch_size={batch_sizes[first]})",
        f"no node count in [{min_nodes}, {cap}]{loading} splits it into whole micro-batches of "
        f"micro_batch_size={micro_batch_size} x devices_per_node={placement.devices_per_node}"
        + (f"; nor stage(s) {others}" if others else ""),
        f"use a nearby global batch size ({suggestions}) in batch.rampup/schedule"
        + (
            f", or micro_batch_size {micros} (each fits every stage)"
            if micros
            else ", or change micro_batch_size"
        )
        + ", or cluster.min_nodes",
    )


MICRO_BATCH_TRIES = 32
"""How many candidate micro batches on each side of the given one `_fitting_micro_batches` tries."""


def divisors(value: int) -> list[int]:
    """The divisors of a positive `value`, ascending (trial division up to its square root)."""
    small, large = [], []
    factor = 1
    while factor * factor <= value:
        if value % factor == 0:
            small.append(factor)
            if factor * factor != value:
                large.append(value // factor)
        factor += 1
    return small + large[::-1]


def _fitting_micro_batches(
    micro_batch_size: int, *, walk: Callable[[int], list[int | None]], batch_sizes: Sequence[int]
) -> str:
    """The nearest micro batch sizes below and above `micro_batch_size` that fit every stage. A micro batch
    that fits divides every stage's batch, so only the divisors of their greatest common divisor are
    tried, the `MICRO_BATCH_TRIES` nearest on each side."""
    common = math.gcd(*batch_sizes)
    if common > MAX_DIVISOR_SEARCH:
        return ""  # a batch this large is refused for its size first (plan/checks.length_problems)
    candidates = divisors(common)
    below = [m for m in reversed(candidates) if m < micro_batch_size][:MICRO_BATCH_TRIES]
    above = [m for m in candidates if m > micro_batch_size][:MICRO_BATCH_TRIES]
    found = []
    for side in (below, above):
        fitting = next((m for m in side if None not in walk(m)), None)
        found += [str(fitting)] if fitting is not None else []
    return " or ".join(found)


MAX_DIVISOR_SEARCH = 10**12
"""The largest common batch `_fitting_micro_batches` factors (trial division: a million steps at most)."""
