"""Node scheduling per ramp-up stage (NeMo launcher rule).

Walking down from the target batch, which may use up to `max_nodes`, each smaller batch `b` gets the
largest node count `n <= nodes(next larger batch)` (and `>= min_nodes`) such that
`b % (micro_batch_size x data_parallel_size(n)) == 0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from batchpilot.errors import BatchpilotError


def data_parallel_size(
    *, num_nodes: int, devices_per_node: int, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1
) -> int | None:
    """devices / (pipeline x tensor parallel sizes), or None when that is not a whole number."""
    devices = num_nodes * devices_per_node
    model_parallel = pipeline_parallel_size * tensor_parallel_size
    return devices // model_parallel if devices % model_parallel == 0 else None


def fits(
    *,
    global_batch_size: int,
    num_nodes: int,
    micro_batch_size: int,
    devices_per_node: int,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> bool:
    """Whether `global_batch_size` splits into whole micro-batches on `num_nodes` nodes."""
    dp = data_parallel_size(
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        pipeline_parallel_size=pipeline_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
    )
    return dp is not None and global_batch_size % (micro_batch_size * dp) == 0


def nearest_valid_batch_sizes(
    global_batch_size: int,
    *,
    node_range: range,
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


def schedule_nodes(
    *,
    batch_sizes: Sequence[int],
    micro_batch_size: int,
    devices_per_node: int,
    max_nodes: int,
    min_nodes: int = 1,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> list[int]:
    """Node count for each (ascending) global batch size; raises naming the first stage that cannot fit."""
    assert list(batch_sizes) == sorted(batch_sizes), batch_sizes
    if min_nodes > max_nodes:
        raise BatchpilotError("cluster.min_nodes", f"{min_nodes} exceeds cluster.max_nodes {max_nodes}")
    nodes: list[int] = [0] * len(batch_sizes)
    cap = max_nodes
    for index in reversed(range(len(batch_sizes))):
        batch = batch_sizes[index]
        chosen = next(
            (
                n
                for n in range(cap, min_nodes - 1, -1)
                if fits(
                    global_batch_size=batch,
                    num_nodes=n,
                    micro_batch_size=micro_batch_size,
                    devices_per_node=devices_per_node,
                    pipeline_parallel_size=pipeline_parallel_size,
                    tensor_parallel_size=tensor_parallel_size,
                )
            ),
            None,
        )
        if chosen is None:
            _raise_no_fit(
                index,
                batch,
                cap,
                min_nodes,
                micro_batch_size,
                devices_per_node,
                pipeline_parallel_size,
                tensor_parallel_size,
            )
        nodes[index] = cap = chosen
    return nodes


def _raise_no_fit(
    index: int, batch: int, cap: int, min_nodes: int, micro: int, devices_per_node: int, pp: int, tp: int
) -> NoReturn:
    below, above = nearest_valid_batch_sizes(
        batch,
        node_range=range(min_nodes, cap + 1),
        micro_batch_size=micro,
        devices_per_node=devices_per_node,
        pp=pp,
        tp=tp,
    )
    suggestions = " or ".join(str(b) for b in (below, above) if b is not None) or "none"
    raise BatchpilotError(
        f"stage {index} (global_batch_size={batch})",
        f"no node count in [{min_nodes}, {cap}] splits it into whole micro-batches of "
        f"micro_batch_size={micro} x devices_per_node={devices_per_node}",
        f"use a nearby global batch size ({suggestions}) in batch.rampup/schedule, or change "
        "micro_batch_size or cluster.min_nodes",
    )
