"""Node pools behind one small interface: resize, wait until ready, current size, describe.

Two implementations:
- `LocalNodePool` (backend `local`): a "node" is a group of `devices_per_node` processes on this
  machine. The pool size is recorded in a small JSON file so that `batchpilot pool` and the pipeline
  steps (separate processes) agree on it; resizing checks that this machine can host the processes.
- `GkeNodePool` (backend `gke`, in `batchpilot.cluster.gke`): a GKE node pool through the Container API,
  with node readiness read from the Kubernetes API.
- `TpuSlicePool` (backend `gke` with a TPU `accelerator_type`, in `batchpilot.cluster.tpu_pool`): one
  GKE node pool per TPU slice shape, created and deleted whole (multi-host slices cannot be resized).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from batchpilot.cluster.capacity import CapacityShortfall
from batchpilot.config import ClusterConfig, Config
from batchpilot.errors import BatchpilotError
from batchpilot.files import write_atomically
from batchpilot.planning.tpu import is_tpu

logger = logging.getLogger(__name__)


@runtime_checkable
class NodePool(Protocol):
    """Where a stage's trainers run: a set of identical nodes whose count batchpilot controls."""

    def current_size(self) -> int:
        """The number of nodes the pool has now."""
        ...

    def resize(self, num_nodes: int) -> None:
        """Asks for `num_nodes` nodes; returns when the request is done (not when nodes are ready)."""
        ...

    def wait_ready(self, num_nodes: int, *, timeout_s: float) -> None:
        """Returns when `num_nodes` nodes can run trainers; raises saying what is missing on timeout."""
        ...

    def describe(self) -> str:
        """One line: which pool, its size and its mode."""
        ...


def node_pool_for(config: Config, *, state_path: str | Path | None = None) -> NodePool:
    """The node pool of `config.cluster.backend`.

    Args:
        config: the whole config (the run name locates the local pool's state file).
        state_path: local backend only: overrides `cluster.pool_state_path`.
    """
    cluster = config.cluster
    if cluster.backend == "local":
        warn_ignored_gke_settings(cluster)
        path = state_path or cluster.pool_state_path or f"runs/{config.name}/pool.json"
        return LocalNodePool(
            state_path=Path(path),
            devices_per_node=cluster.devices_per_node,
            max_nodes=cluster.max_nodes,
            capacity_nodes=cluster.local_capacity_nodes,
            state_field="--pool-state" if state_path else "cluster.pool_state_path",
            resize_delay_s=cluster.local_resize_delay_s,
        )
    if state_path is not None:
        raise BatchpilotError("--pool-state", "only the local backend keeps its pool size in a file")
    if is_tpu(cluster.accelerator_type):
        from batchpilot.cluster.tpu_pool import tpu_node_pool

        return tpu_node_pool(cluster, run=config.name)
    from batchpilot.cluster.gke import gke_node_pool

    return gke_node_pool(cluster)


_GKE_ONLY = (
    "project",
    "location",
    "cluster_name",
    "node_pool",
    "accelerator_type",
    "kueue_queue",
    "priority_class",
    "container_api_endpoint",
)


def warn_ignored_gke_settings(cluster: ClusterConfig) -> None:
    """Says which gke-only settings a local run ignores (they stay valid for a later gke run)."""
    ignored = [name for name in _GKE_ONLY if getattr(cluster, name)]
    if ignored and cluster.pool_mode != "resize":
        ignored.append("pool_mode")
    if ignored:
        logger.warning("cluster.backend is local; ignoring gke settings %s", ", ".join(ignored))


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LocalNodePool:
    """A pool of local "nodes", each `devices_per_node` processes; its size lives in a JSON file.

    The file is what makes a resize observable: `wait_ready` and `current_size`, possibly in another
    process, read it back. A node costs one CPU per process, so a size this machine cannot host is
    refused instead of being recorded.
    """

    def __init__(
        self,
        *,
        state_path: Path,
        devices_per_node: int,
        max_nodes: int,
        capacity_nodes: int | None = None,
        state_field: str = "cluster.pool_state_path",
        resize_delay_s: float = 0.0,
    ) -> None:
        self.state_path = state_path
        self.resize_delay_s = resize_delay_s
        """`cluster.local_resize_delay_s`: a growing pool's new nodes are ready this long after the resize."""
        self.state_field = state_field
        """The setting that named `state_path` (`--pool-state` or the config's), for error lines."""
        self.devices_per_node = devices_per_node
        self.max_nodes = max_nodes
        self.capacity_nodes = capacity_nodes
        """`cluster.local_capacity_nodes`: a resize beyond it gets this many nodes (a stockout's stand-in)."""

    def current_size(self) -> int:
        """The recorded size; 0 when the pool was never resized (nothing runs yet)."""
        # Never "delete the file": it may be anyone's (`--pool-state /etc/passwd`), not one batchpilot wrote.
        fix = (
            f"point {self.state_field} at a pool state file batchpilot wrote, or at a new path (it starts as "
            "an empty pool)"
        )
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return 0
        except IsADirectoryError:
            raise BatchpilotError(
                self.state_field, f"{self.state_path} is a folder, not a pool state file", fix
            ) from None
        except (OSError, ValueError) as error:
            reason = "not JSON" if isinstance(error, ValueError) else (error.strerror or type(error).__name__)
            raise BatchpilotError(
                self.state_field,
                f"cannot read the local pool state {self.state_path}: it is not a pool state file ({reason})",
                fix,
            ) from None
        num_nodes = state.get("num_nodes") if isinstance(state, dict) else None
        if type(num_nodes) is not int or num_nodes < 0:
            raise BatchpilotError(
                self.state_field,
                f"{self.state_path} is not a pool state file (it holds no valid num_nodes)",
                fix,
            )
        return num_nodes

    def resize(self, num_nodes: int) -> None:
        """Records `num_nodes` after checking that this machine can run that many processes; with a
        capacity limit, records what the limit grants (and what was asked for)."""
        self._check_capacity(num_nodes)
        before = self.current_size()
        granted = num_nodes if self.capacity_nodes is None else min(num_nodes, self.capacity_nodes)
        if granted < num_nodes:
            logger.warning(
                "local pool: %d of %d node(s) granted (cluster.local_capacity_nodes: %d)",
                granted, num_nodes, self.capacity_nodes,
            )  # fmt: skip
        state = {
            "num_nodes": granted,
            "requested_nodes": num_nodes,
            "devices_per_node": self.devices_per_node,
            "updated_unix_s": round(time.time(), 3),
        }
        if self.resize_delay_s and granted > before:  # the modelled resize: new nodes come that much later
            state["ready_unix_s"] = round(time.time() + self.resize_delay_s, 3)
        elif granted == before and (previous := self._state()).get("ready_unix_s"):
            state["ready_unix_s"] = previous["ready_unix_s"]  # asked again for the size coming: same nodes
        # Atomic, so a concurrent reader sees the old or the new size, never half a file.
        write_atomically(self.state_path, json.dumps(state, indent=2) + "\n")

    def wait_ready(self, num_nodes: int, *, timeout_s: float) -> None:
        """Local nodes are ready as soon as they are recorded (or, with `cluster.local_resize_delay_s`, when
        their modelled resize ends, waited for within `timeout_s`); raises when fewer are recorded."""
        self._check_capacity(num_nodes)
        recorded = self.current_size()
        ready_at = self._state().get("ready_unix_s")
        if recorded >= num_nodes and ready_at is not None and ready_at > time.time():
            if ready_at - time.time() > timeout_s:
                raise BatchpilotError(
                    "cluster.local_resize_delay_s",
                    f"the local pool's {recorded} node(s) are ready in {ready_at - time.time():.0f} s, after "
                    f"the {timeout_s:g} s this wait may take",
                    "lower cluster.local_resize_delay_s",
                )
            time.sleep(ready_at - time.time())
        if recorded < num_nodes and self.capacity_nodes is not None and recorded == self.capacity_nodes:
            raise CapacityShortfall(
                "cluster.local_capacity_nodes",
                f"the local pool granted {recorded} of {num_nodes} node(s)",
                "raise cluster.local_capacity_nodes, or set cluster.fewer_nodes: allow to train on the nodes "
                "granted",
                ready=recorded, wanted=num_nodes,
            )  # fmt: skip
        if recorded < num_nodes:
            raise BatchpilotError(
                "cluster",
                f"the local pool has {recorded} node(s) recorded in {self.state_path}, {num_nodes} are needed",
                f"run `batchpilot pool resize --nodes {num_nodes}` first",
            )

    def _state(self) -> dict:
        """The state file's fields ({} before the first resize); `current_size` checked it."""
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}
        return state if isinstance(state, dict) else {}

    def describe(self) -> str:
        """The recorded size, the state file and this machine's CPU count."""
        size = self.current_size()
        return (
            f"local pool: {size} node(s) x {self.devices_per_node} process(es) "
            f"(state {self.state_path}; this machine has {available_cpus()} CPU(s))"
        )

    def _check_capacity(self, num_nodes: int) -> None:
        if num_nodes < 0:
            raise BatchpilotError("--nodes", f"{num_nodes} is negative", "give 0 or more nodes")
        if num_nodes > self.max_nodes:
            raise BatchpilotError(
                "--nodes",
                f"{num_nodes} node(s) exceed cluster.max_nodes ({self.max_nodes})",
                "raise cluster.max_nodes or ask for fewer nodes",
            )
        needed = num_nodes * self.devices_per_node
        cpus = available_cpus()
        if needed > cpus:
            raise BatchpilotError(
                "cluster.devices_per_node",
                f"{num_nodes} local node(s) x {self.devices_per_node} process(es) = {needed} processes, "
                f"but this machine has {cpus} CPU(s)",
                "use fewer nodes or devices_per_node, or the gke backend",
            )
