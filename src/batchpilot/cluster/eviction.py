"""Why the train task got SIGTERM: an eviction (leave the JobSet to the retry) or a cancel (delete it).

Two things send a KFP task's container SIGTERM, and they need opposite answers:
- A cancel or a deadline. KFP terminates a run by setting the Argo workflow's
  `activeDeadlineSeconds` to 0 (kubeflow/pipelines backend/src/apiserver/resource/resource_manager.go),
  and past a deadline Argo stops each running pod with TerminateContainers: SIGTERM to its containers
  through exec, SIGKILL after the grace period, without deleting the pod object
  (argo-workflows workflow/controller/exec_control.go, workflow/controller/pod/queue.go). The JobSet
  must go, or it keeps the GPUs after the run.
- An eviction: a node drain or upgrade, a cluster-autoscaler scale-down (both through the Eviction
  API), preemption, a graceful node shutdown. Kubernetes adds the condition `DisruptionTarget=True` and
  deletes the pod (deletionTimestamp set) before the kubelet sends SIGTERM (kubernetes.io "Pod
  disruption conditions"). Only the CPU pod that follows the JobSet is going away; the trainers are
  fine, so the JobSet stays and KFP's retry of the task adopts it.

`sigterm_interrupts` turns SIGTERM into `Cancelled` (a KeyboardInterrupt: cleaned up as Ctrl-C is) or
`Evicted` (which nothing on its way up takes for a cancel). The task reads its own pod
(`BATCHPILOT_POD_NAME` / `BATCHPILOT_POD_NAMESPACE`, from the downward API).
A pod it cannot read counts as a cancel: leaving a JobSet of a cancelled run would hold the GPUs until
someone notices (the exit handler may be the thing that failed), while deleting an evicted launch's
JobSet costs only the steps since its last checkpoint (`train.checkpoint_every_s`): the retry resumes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

POD_NAME_ENV = "BATCHPILOT_POD_NAME"
POD_NAMESPACE_ENV = "BATCHPILOT_POD_NAMESPACE"


@dataclass(frozen=True)
class SigtermCause:
    """What a SIGTERM means for the launch's JobSet."""

    eviction: bool
    why: str


def sigterm_cause(
    *, env: Mapping[str, str] = os.environ, api_client: Callable[[], Any] | None = None
) -> SigtermCause:
    """Reads the task's own pod: deleted or `DisruptionTarget=True` -> an eviction; else a cancel.

    Args:
        env: where the downward API put the pod's name and namespace.
        api_client: makes a Kubernetes API client (default: in-cluster, else kubeconfig).
    """
    name, namespace = env.get(POD_NAME_ENV), env.get(POD_NAMESPACE_ENV)
    if not name or not namespace:
        return SigtermCause(False, f"no {POD_NAME_ENV}/{POD_NAMESPACE_ENV}: not a pipeline task pod")
    try:
        from kubernetes import client

        if api_client is None:
            from batchpilot.cluster.readiness import kube_api_client

            api_client = kube_api_client
        pod = client.CoreV1Api(api_client()).read_namespaced_pod(name, namespace, _request_timeout=10)
    except Exception as error:  # any failure to read: the safer default, said out loud
        return SigtermCause(False, f"cannot read pod {namespace}/{name} ({_short(error)}); taken as a cancel")
    for condition in pod.status.conditions or []:
        if condition.type == "DisruptionTarget" and condition.status == "True":
            return SigtermCause(True, f"pod {name} has DisruptionTarget ({condition.reason})")
    if pod.metadata.deletion_timestamp:
        return SigtermCause(True, f"pod {name} is being deleted")
    return SigtermCause(False, f"pod {name} is not being deleted (a cancel or a deadline)")


def _short(error: BaseException) -> str:
    status = getattr(error, "status", None)
    text = str(getattr(error, "reason", None) or error).splitlines()[0][:200]
    return f"HTTP {status} {text}" if status else text


class Evicted(BaseException):
    """Raised by SIGTERM when the task's pod is being evicted. Not a KeyboardInterrupt, so nothing on the
    way up (follow() cancels its job on KeyboardInterrupt) deletes the JobSet."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Cancelled(KeyboardInterrupt):
    """Raised by SIGTERM when it is no eviction: cleaned up as Ctrl-C is."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@contextlib.contextmanager
def sigterm_interrupts(classify: Callable[[], Any] | None = None) -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (`Cancelled`), so it cleans up as Ctrl-C does;
    or `Evicted` when `classify()` (a `batchpilot.cluster.eviction.SigtermCause`) says it is an eviction.

    KFP stops a cancelled run's task by stopping its pod, and a pod is stopped with SIGTERM to its main
    process, SIGKILL after the grace period (Kubernetes "Pod termination"); Python's default for SIGTERM
    is to die at once, leaving the JobSet running on the GPUs. Only the main thread can set a handler.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the clean-up
        cause = classify() if classify is not None else None
        if cause is not None and cause.eviction:
            raise Evicted(cause.why)
        raise Cancelled(cause.why if cause is not None else f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
