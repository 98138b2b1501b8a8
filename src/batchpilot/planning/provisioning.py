"""Settings that `cluster.provisioning: flex-start` (a ProvisioningRequest per launch, class
`queued-provisioning.gke.io`; `batchpilot.cluster.provisioning`) cannot work with, checked before anything
is paid for. Pure: the planner calls it for `config check`, `plan` and `compile`.

The rules follow GKE's "Run a large-scale workload with flex-start with queued provisioning": the class is
GKE's, for GPU node pools in this project (GKE's TPU flex-start requests need the slice's topology and a
pool per slice, which batchpilot's slice pools do not make), and a request is granted whole or not at all.
"""

from __future__ import annotations

from batchpilot.errors import BatchpilotError
from batchpilot.planning.tpu import is_tpu


def provisioning_problems(
    *,
    provisioning: str,
    backend: str,
    launcher: str,
    accelerator_type: str | None,
    pool_mode: str,
    fewer_nodes: str,
) -> list[BatchpilotError]:
    """Every setting flex-start cannot work with, one error each naming the field and the fix ([] unless
    `provisioning` is flex-start). The arguments are the `cluster.` fields of the same names."""
    if provisioning != "flex-start":
        return []
    problems: list[BatchpilotError] = []
    if backend != "gke":
        problems.append(
            BatchpilotError(
                "cluster.provisioning",
                f"flex-start asks GKE for nodes, but cluster.backend is {backend}",
                "set cluster.backend: gke, or cluster.provisioning: resize",
            )
        )
    if launcher != "jobset":
        problems.append(
            BatchpilotError(
                "cluster.launcher",
                f"flex-start needs the jobset launcher (its pods consume the launch's ProvisioningRequest), not {launcher}",
                "set cluster.launcher: jobset, or cluster.provisioning: resize",
            )
        )
    if is_tpu(accelerator_type):
        problems.append(
            BatchpilotError(
                "cluster.provisioning",
                f"flex-start is not supported here for TPU slices ({accelerator_type}): batchpilot makes one "
                "slice pool per shape, not a queued-provisioning pool per slice",
                "set cluster.provisioning: resize",
            )
        )
    elif not accelerator_type and backend == "gke":
        problems.append(
            BatchpilotError(
                "cluster.accelerator_type",
                "flex-start with queued provisioning is for GPU node pools, but no accelerator_type is set",
                "set cluster.accelerator_type to the pool's GPU type (e.g. nvidia-h100-80gb), or "
                "cluster.provisioning: resize",
            )
        )
    if pool_mode == "static":
        problems.append(
            BatchpilotError(
                "cluster.pool_mode",
                "static cannot be used with flex-start: GKE's autoscaler adds a queued-provisioning pool's "
                "nodes for each ProvisioningRequest and removes them after",
                "set cluster.pool_mode: resize or autoscale (with flex-start neither sets the pool's size)",
            )
        )
    if fewer_nodes == "allow":
        problems.append(
            BatchpilotError(
                "cluster.fewer_nodes",
                "allow has no effect with flex-start: GKE grants a ProvisioningRequest's nodes (batchpilot's, or "
                "those of Kueue's admission check with cluster.kueue_queue) all at once or none, so a launch never "
                "gets some of its nodes",
                "set cluster.fewer_nodes: fail, or cluster.provisioning: resize",
            )
        )
    # With kueue_queue, Kueue's ProvisioningRequest admission check asks GKE for the nodes instead of
    # batchpilot (cluster/kueue.py); every rule above holds for its requests too.
    return problems
