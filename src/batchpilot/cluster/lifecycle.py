"""A launch's JobSets over their life: adopt a retried launch's running one, delete stale ones before a
create, delete the run's at its end (docs/cluster.md, "Lifecycle").

JobSets are found by their labels (`launch_spec.stage_labels`): the run, the launch (`STAGE_LABEL`) and the
plan. Deletion is Foreground and waited for, so the GPUs are free and no old trainer writes a checkpoint
when the caller goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from batchpilot.cluster.labels import PLAN_LABEL, RUN_LABEL, STAGE_LABEL
from batchpilot.config import ClusterConfig
from batchpilot.errors import BatchpilotError

logger = logging.getLogger(__name__)


def builds_jobset(cluster: ClusterConfig) -> bool:
    """Whether the launcher's job is a JobSet: batchpilot's own (`jobset`) or the one Kubeflow Trainer builds
    for a TrainJob (`trainjob`), named as the TrainJob."""
    return cluster.launcher in ("jobset", "trainjob")


def _kind(cluster: ClusterConfig) -> tuple[str, str, str]:
    """(group, version, plural) of the objects the launcher creates, finds and deletes: JobSets, or TrainJobs
    (deleting a TrainJob's JobSet would only make Trainer build it again)."""
    from batchpilot.cluster import jobset, trainjob

    return trainjob.TRAINJOB_KIND if cluster.launcher == "trainjob" else jobset.JOBSET_KIND


def stage_selector(labels: dict[str, str]) -> dict[str, str]:
    """The labels that find a launch's JobSets, whatever their plan."""
    return {key: labels[key] for key in (RUN_LABEL, STAGE_LABEL)}


def adoptable_or_cleared(*, labels: dict[str, str], cluster: ClusterConfig, name: str) -> str | None:
    """The name of the launch's JobSet of this plan still pending or running (a retried task: it is
    followed, not started twice), else None, after deleting the launch's other JobSets.

    `labels` are the launch's (`launch_spec.stage_labels`). Finished, failed or other-plan JobSets of the launch,
    and pending or running ones of the run's other launches, are deleted first and waited for, so no old
    trainer still holds the GPUs or writes a checkpoint when a new one starts.
    """
    from batchpilot.cluster import jobset
    from batchpilot.cluster.readiness import kube_api_client

    client = kube_api_client()
    of_run = jobset.list_jobsets(
        client, namespace=cluster.namespace, labels={RUN_LABEL: labels[RUN_LABEL]}, kind=_kind(cluster)
    )
    existing = [item for item in of_run if _labels(item).get(STAGE_LABEL) == labels[STAGE_LABEL]]
    live = [item for item in existing if _adoptable(item, plan=labels[PLAN_LABEL])]
    # The run's launches follow one another: another launch's JobSet still pending or running is a
    # leftover (another plan's grouping, a run whose exit handler never ran) that would write the same
    # checkpoints. Finished ones stay for their logs until the exit handler or their TTL.
    others = [item for item in of_run if item not in existing and _running(item)]
    stale = [item["metadata"]["name"] for item in [*existing, *others] if item not in live[:1]]
    if stale:
        _delete_named(client, cluster, names=stale, why="replaced by this launch")
    if not live:
        return None
    found = str(live[0]["metadata"]["name"])
    logger.info("%s: adopting its running JobSet %s (a retried launch)", name, found)
    return found


def running_jobset(*, labels: dict[str, str], cluster: ClusterConfig) -> str | None:
    """The name of the launch's JobSet of this plan still pending or running (what `adoptable_or_cleared`
    would adopt), else None; deletes nothing."""
    from batchpilot.cluster import jobset
    from batchpilot.cluster.readiness import kube_api_client

    found = jobset.list_jobsets(
        kube_api_client(), namespace=cluster.namespace, labels=stage_selector(labels), kind=_kind(cluster)
    )
    live = [item for item in found if _adoptable(item, plan=labels[PLAN_LABEL])]
    return str(live[0]["metadata"]["name"]) if live else None


def _labels(item: dict[str, Any]) -> dict[str, str]:
    return item["metadata"].get("labels") or {}


def _running(item: dict[str, Any]) -> bool:
    """Whether a JobSet (or TrainJob) is pending or running and not being deleted."""
    from torchx.specs import AppState

    from batchpilot.cluster.jobset import jobset_state
    from batchpilot.cluster.trainjob import trainjob_state

    if item["metadata"].get("deletionTimestamp"):
        return False
    if item.get("kind") == "TrainJob":
        return trainjob_state(item) is None
    return jobset_state(item.get("status")) in (AppState.PENDING, AppState.RUNNING)


def _adoptable(item: dict[str, Any], *, plan: str) -> bool:
    return _labels(item).get(PLAN_LABEL) == plan and _running(item)


def _delete_wait_s() -> float:
    """How long a deletion may take: the pods' grace period to checkpoint, plus a minute for the API."""
    from batchpilot.cluster.placement import TERMINATION_GRACE_S

    return TERMINATION_GRACE_S + 60.0


def _delete_named(client: Any, cluster: ClusterConfig, *, names: list[str], why: str) -> None:
    """Deletes the JobSets and waits until they are gone; raises when one outlives the wait."""
    from batchpilot.cluster import jobset

    what = "TrainJob(s)" if cluster.launcher == "trainjob" else "JobSet(s)"
    logger.info("deleting %s %s (%s)", what, ", ".join(names), why)
    remaining = jobset.delete_jobsets(
        client, namespace=cluster.namespace, names=names, wait_s=_delete_wait_s(), kind=_kind(cluster)
    )
    if remaining:
        noun = "TrainJob" if cluster.launcher == "trainjob" else "JobSet"
        raise BatchpilotError(
            f"{noun} {remaining[0]}",
            f"is still being deleted after {_delete_wait_s():.0f}s",
            f"see `kubectl -n {cluster.namespace} describe {noun.lower()} {remaining[0]}`, then launch again",
        )


def delete_labelled(cluster: ClusterConfig, *, labels: dict[str, str], wait_s: float, why: str) -> list[str]:
    """Deletes every JobSet (TrainJob with the trainjob launcher) carrying `labels`, waits up to `wait_s` for
    them; returns their names."""
    from batchpilot.cluster import jobset
    from batchpilot.cluster.readiness import kube_api_client

    client, kind = kube_api_client(), _kind(cluster)
    names = [
        item["metadata"]["name"]
        for item in jobset.list_jobsets(client, namespace=cluster.namespace, labels=labels, kind=kind)
    ]
    if not names:
        return []
    what = "TrainJob(s)" if cluster.launcher == "trainjob" else "JobSet(s)"
    logger.info("deleting %s %s (%s)", what, ", ".join(names), why)
    remaining = jobset.delete_jobsets(
        client, namespace=cluster.namespace, names=names, wait_s=wait_s, kind=kind
    )
    if remaining and wait_s:
        logger.warning("%s %s still terminating after %.0fs", what, ", ".join(remaining), wait_s)
    return names


def delete_run_jobs(*, cluster: ClusterConfig, run: str) -> list[str]:
    """Deletes every JobSet of the run (label RUN_LABEL=`run`) and waits for their pods to stop; returns
    their names. The exit handler calls it before the pool shrinks, so no trainer is cut off mid-checkpoint."""
    if not builds_jobset(cluster):
        return []
    names = delete_labelled(
        cluster, labels={RUN_LABEL: run}, wait_s=_delete_wait_s(), why=f"the end of run {run}"
    )
    if (
        cluster.provisioning == "flex-start"
    ):  # a cancelled or evicted launch's request, still asking or holding
        from batchpilot.cluster.provisioning import delete_run_requests
        from batchpilot.cluster.readiness import kube_api_client

        delete_run_requests(api_client=kube_api_client(), namespace=cluster.namespace, run=run)
    return names
