"""`batchpilot doctor`: is the cluster in front of the user the one the config and its plan assume?

Each check is a small function of what the checks before it found (`Context.found`) that returns one
`Check`: passed, FAILED with the fix, or skipped with why. A check whose prerequisite did not pass is
skipped, not run (no credentials: no Container API call). Every network call has a short timeout
(`CALL_TIMEOUT_S`) and no long retry, and each check runs under its own bound (`CHECK_TIMEOUT_S`), so an
unreachable endpoint costs seconds, not minutes.

Order on gke: plan, credentials, node pool, kubernetes, quota, rbac, jobset crd, gpu driver, gpu nodes,
data, checkpoint, kfp, argo retries. On local: plan, cloud (skipped), cpus, (credentials when a URI is gs://), data,
checkpoint, kfp. The Kubernetes checks run as whoever the kubeconfig (or the pod's service account) is:
the KFP run's own account may hold other grants (docs/cluster.md, "Identity").
"""

from __future__ import annotations

from collections.abc import Iterator

from batchpilot.config import Config
from batchpilot.doctor.argo import check_argo_retries
from batchpilot.doctor.core import Check, Context, Step, bounded
from batchpilot.doctor.google import check_credentials, check_node_pool, check_quota
from batchpilot.doctor.kfp_api import check_kfp
from batchpilot.doctor.kube import (
    check_gpu_driver,
    check_gpu_nodes,
    check_jobset_crd,
    check_kubernetes,
    check_kueue,
    check_kueue_explore,
    check_rbac,
    check_training_runtime,
)
from batchpilot.doctor.plan import check_cpus, check_plan, skip_cloud
from batchpilot.doctor.storage import check_checkpoint, check_data

__all__ = ["Check", "run_checks", "steps"]


def run_checks(
    config: Config,
    *,
    kfp_host: str | None = None,
    kfp_token: str | None = None,
    kfp_namespace: str = "kubeflow",
) -> Iterator[Check]:
    """Every check for `config`, in order, each as soon as it is done."""
    context = Context(config=config, kfp_host=kfp_host, kfp_token=kfp_token, kfp_namespace=kfp_namespace)
    for name, step in steps(config):
        check = bounded(name, step, context)
        if check.status == "passed":
            context.found[name] = check.found
        yield check


def steps(config: Config) -> list[Step]:
    storage = [("data", check_data), ("checkpoint", check_checkpoint), ("kfp", check_kfp)]
    if config.cluster.backend == "local":
        uris = (config.data.uri, config.train.checkpoint_uri)
        google = [("credentials", check_credentials)] if any(u.startswith("gs://") for u in uris) else []
        return [("plan", check_plan), ("cloud", skip_cloud), ("cpus", check_cpus), *google, *storage]
    return [
        ("plan", check_plan),
        ("credentials", check_credentials),
        ("node pool", check_node_pool),
        ("kubernetes", check_kubernetes),
        ("quota", check_quota),
        ("rbac", check_rbac),
        ("jobset crd", check_jobset_crd),
        *(
            [("kueue", check_kueue), ("kueue explore", check_kueue_explore)]
            if config.cluster.kueue_queue
            else []
        ),
        *([("training runtime", check_training_runtime)] if config.cluster.launcher == "trainjob" else []),
        ("gpu driver", check_gpu_driver),
        ("gpu nodes", check_gpu_nodes),
        *storage,
        ("argo retries", check_argo_retries),
    ]
