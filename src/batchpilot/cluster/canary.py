"""The canary job: a short launch on the first launch's nodes before anything trains (rank side:
`batchpilot.train.canary`).

It is a launch like the trainers' (`launch_spec.LaunchSpec`), run by the same `run_local` / `run_cluster`, so it
gets exactly their pods, labels, pending bound and eviction handling. Its spec (the config, the node count,
where to write, the expected bus bandwidth) travels as the run document does: in BATCHPILOT_PLAN_JSON,
written to a file in the pod before torchrun starts (`launch_spec.write_inputs_command`).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchpilot.cluster.launch_spec import TRAINER_DIR, LaunchSpec, stage_labels
from batchpilot.cluster.machines import expected_bus_bandwidth_bytes_per_s
from batchpilot.config import Config
from batchpilot.exitcodes import CANARY_FAILED_MARKER
from batchpilot.planning.gpudirect import MACHINE_STACKS, PRIMARY_NIC_GBPS
from batchpilot.runstate import canary_uri

CANARY_NAME = "canary"
"""The canary's launch name: its job's stage label and name suffix (`<run>-canary`)."""
CANARY_FOLDER = "canary"
"""Under `train.checkpoint_uri`: the probes and canary.json."""
NCCL_DEBUG_ENV = {
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
    "NCCL_DEBUG_FILE": "/tmp/batchpilot-nccl.%h.%p.log",
}
"""On the canary's GPU pods: NCCL's INFO lines of its init and network subsystems (its version, the network
transport it chose), into a file per process rather than the pods' logs (NCCL's environment variables:
NCCL_DEBUG_FILE expands %h to the host name and %p to the process id); each rank reads its own file."""


def canary_nodes(
    *, max_nodes: int, first_launch_nodes: int | None, max_stage_nodes: int | None, flex_start: bool = False
) -> int:
    """The canary's node count.

    With a plan: the first launch's nodes, and at least two when any stage spans more than one node (and
    `cluster.max_nodes` allows), so the cross-node all-reduce is measured before it is needed; with
    flex-start exactly the first launch's, whose ProvisioningRequest it runs on and hands over. Without a
    plan (the pipeline explores first): two nodes when `max_nodes` allows, else one.
    """
    if first_launch_nodes is None or max_stage_nodes is None:
        return min(2, max_nodes) if max_nodes > 1 else 1
    if flex_start:
        return first_launch_nodes
    if max_stage_nodes > 1 and max_nodes >= 2:
        return max(first_launch_nodes, 2)
    return first_launch_nodes


def result_uri(config: Config) -> str:
    """`<train.checkpoint_uri>/canary`: where the probes go and rank 0 writes canary.json."""
    return canary_uri(config.train.checkpoint_uri)


def canary_spec(config: Config, *, num_nodes: int) -> dict[str, Any]:
    """What every canary rank reads (`train.canary.read_spec`)."""
    cluster = config.cluster
    expected = expected_bus_bandwidth_bytes_per_s(machine_type_name=cluster.machine_type, num_nodes=num_nodes)
    if cluster.gpudirect == "off" and cluster.machine_type in MACHINE_STACKS and expected is not None:
        # The GPU NICs are left out: the primary NIC carries the all-reduce (None: no documented figure).
        primary_gbps = PRIMARY_NIC_GBPS.get(cluster.machine_type)
        expected = primary_gbps * 1e9 / 8 if primary_gbps else None
    return {
        "config": config.model_dump(mode="json"),
        "num_nodes": num_nodes,
        "result_uri": result_uri(config),
        "expected_bus_bandwidth_bytes_per_s": expected,
    }


def canary_launch_spec(config: Config, *, spec: dict[str, Any], spec_path: str | None) -> LaunchSpec:
    """The canary as a launch: `batchpilot canary-rank --spec FILE` on `spec["num_nodes"]` nodes, one
    process per device. `spec_path`: a local run's spec file; None on a cluster, where the spec rides in
    BATCHPILOT_PLAN_JSON and the pod writes it to TRAINER_DIR/plan.json first."""
    from batchpilot.planning.names import jobset_name

    num_nodes, per_node = int(spec["num_nodes"]), config.cluster.devices_per_node
    if spec_path is not None:
        args = ("canary-rank", "--spec", spec_path)
        return LaunchSpec(f"{config.name}-{CANARY_NAME}", num_nodes, per_node, args, env={})
    from batchpilot.cluster.launch_spec import _torchrun_shutdown_env

    compact = json.dumps(spec, separators=(",", ":"))
    return LaunchSpec(
        name=jobset_name(run_name=config.name, launch_name=CANARY_NAME),
        num_nodes=num_nodes,
        processes_per_node=per_node,
        trainer_args=("canary-rank", "--spec", f"{TRAINER_DIR}/plan.json"),
        env={"BATCHPILOT_PLAN_JSON": compact, **_torchrun_shutdown_env(), **_nccl_env(config)},
        labels=stage_labels(run_name=config.name, stage_name=CANARY_NAME, plan_text=compact),
    )


def _nccl_env(config: Config) -> dict[str, str]:
    from batchpilot.planning.tpu import is_tpu

    gpus = bool(config.cluster.accelerator_type) and not is_tpu(config.cluster.accelerator_type)
    return dict(NCCL_DEBUG_ENV) if gpus else {}


class _FailureLines(io.TextIOBase):
    """stdout that remembers the first canary failure line passing through (the launchers relay every
    rank's lines to stdout)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self._pending = stream, ""
        self.first: str | None = None

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if self.first is None and CANARY_FAILED_MARKER in line:
                self.first = line.split(CANARY_FAILED_MARKER, 1)[1].strip()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def failure_lines() -> Iterator[_FailureLines]:
    """While open, stdout goes through a `_FailureLines` (yielded)."""
    tee = _FailureLines(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee


def run_canary_job(
    config: Config, *, spec: dict[str, Any], work_dir: Path | None, first_launch: LaunchSpec | None = None
) -> tuple[int, str | None]:
    """Runs the canary job (torchx local_cwd with its spec in `work_dir`, or on GKE); returns the job's
    exit code and the first failure line a rank printed (after CANARY_FAILED_MARKER), if any.

    `first_launch` (flex-start): the canary runs on that launch's ProvisioningRequest and, when it passes,
    leaves the request (and its nodes) to it, instead of queueing for nodes of its own that it would release
    just before the first launch queues again."""
    from batchpilot.cluster import launch

    with failure_lines() as lines:
        if config.cluster.backend == "gke":
            code = launch.run_cluster(
                canary_launch_spec(config, spec=spec, spec_path=None), cluster=config.cluster,
                capacity_of=first_launch if config.cluster.provisioning == "flex-start" else None,
            )  # fmt: skip
        else:
            assert work_dir is not None
            work_dir.mkdir(parents=True, exist_ok=True)
            path = work_dir / "canary-spec.json"
            path.write_text(json.dumps(spec))
            local = canary_launch_spec(config, spec=spec, spec_path=str(path))
            code = launch.run_local(local, log_dir=work_dir / "torchx")
    return code, lines.first
