"""KFP's backend for the simulated cluster: a created run's pipeline executed as KFP on Argo runs it, its
task pods in the simulator, so that a test (or `batchpilot rehearse`) can watch, delete and terminate them.

What it models, and from where:
- the tasks: the run's config is its `config_yaml` argument (or the compiled default); the pipeline built
  from it runs with kfp.local (`batchpilot.kfp.local.run_pipeline`), each task's component a process here
  that reaches the simulator as a task pod reaches GKE (KUBECONFIG, `container_api_endpoint`);
- each attempt's process has a pod in the simulator (namespace `kubeflow`): the pod KFP's driver makes for
  the task's executor from the compiled pipeline (kfp_driver.executor_pod: requests, node selector, node
  affinity, tolerations, annotations, downward-API env), with label `pipeline/runid` (KFP's API server labels
  every pod of a run, kubeflow/pipelines backend/src/apiserver/template/v2_template.go) and its name in the
  process's environment; the process runs while the pod does (`TaskProcessKubelet`), once the scheduler
  has bound it;
- deleting the pod stops its process group with SIGTERM (the kubelet signals the container's main process,
  and Argo's emissary, that process in a task pod, forwards it to its whole process group: argo-workflows
  cmd/argoexec/commands/emissary.go; the component runs under `sh -c`); the pod keeps its deletionTimestamp
  until the process ended. An attempt whose pod was deleted before it ended is Error ("pod deleted"), one that exited
  non-zero Failed (argo-workflows operator.go; kfp_driver.attempt_phase);
- retries follow Argo's processNodeRetries with the cluster's templateDefaults (`kfp_driver.argo_retry`):
  which phases are retried, the backoff, the limit. The backoff is waited `time_scale` times its length
  (the order of events is Argo's, the test's wall clock is shorter);
- terminate (`POST runs/{id}:terminate`): KFP sets the workflow's deadline to now (resource_manager.go), Argo
  stops each running task pod with SIGTERM and does not delete it (TerminateContainers, pod/queue.go), no
  task starts or is retried after, and the exit handler runs (Argo runs onExit after a failed workflow);
- the run's state: PENDING, RUNNING, then SUCCEEDED, FAILED or, after a terminate, CANCELED.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp_driver import argo_retry, executor_pod

TASK_NAMESPACE = "kubeflow"
EXTERNAL = "sim.batchpilot.test/process"
"""On a task pod whose process this backend runs (not the kubelet)."""
EXIT_HANDLER_COMPONENT = "comp-scale-down"


@dataclass
class _Task:
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    code: int | None = None

    def stop(self) -> None:
        """SIGTERM to the task's process group, as Argo's emissary forwards it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)


@dataclass
class SimKfpBackend:
    sim: Any  # cluster_sim.ClusterSim
    kfp: Any  # kfp_api_server.KfpState
    output: Path
    template_defaults: dict[str, Any] | None = None
    time_scale: float = 0.1
    tasks: dict[str, _Task] = field(default_factory=dict)  # by pod uid
    terminated: threading.Event = field(default_factory=threading.Event)
    last_phase: str = ""
    threads: list[threading.Thread] = field(default_factory=list)
    local: threading.local = field(default_factory=threading.local)  # the executor of this thread's task
    compiled: tuple[dict[str, Any], dict[str, Any]] = ({}, {})  # the run's pipeline spec and platform spec

    # -- the KFP API's hooks -------------------------------------------------------------------------
    def start(self, run: dict[str, Any]) -> None:
        thread = threading.Thread(target=self._run, args=(run["run_id"],), daemon=True)
        self.threads.append(thread)
        thread.start()

    def terminate(self, run_id: str) -> None:
        del run_id
        self.terminated.set()
        for task in list(self.tasks.values()):
            if task.code is None:
                task.stop()  # TerminateContainers: the pod stays

    def _set_state(self, run_id: str, state: str) -> None:
        with self.kfp.lock:
            self.kfp.runs[run_id]["state"] = state

    def _run(self, run_id: str) -> None:
        from batchpilot.config import config_from_text
        from batchpilot.kfp.local import run_pipeline

        run = self.kfp.runs[run_id]
        parameters = (run.get("runtime_config") or {}).get("parameters") or {}
        spec = run["pipeline_spec"].get("pipeline_spec", run["pipeline_spec"])
        self.compiled = (
            spec,
            (run["pipeline_spec"].get("platform_spec") or {}).get("platforms", {}).get("kubernetes", {}),
        )
        default = spec["root"]["inputDefinitions"]["parameters"]["config_yaml"]["defaultValue"]
        config = config_from_text(parameters.get("config_yaml") or default)
        self._set_state(run_id, "RUNNING")
        with self._installed(run_id):
            try:
                run_pipeline(config, output=self.output / run_id)
            except Exception:  # a task failed: kfp.local raises once the exit handler has run
                self._set_state(run_id, "CANCELED" if self.terminated.is_set() else "FAILED")
                return
        self._set_state(run_id, "CANCELED" if self.terminated.is_set() else "SUCCEEDED")

    # -- kfp.local, as Argo would run it ---------------------------------------------------------------
    @contextlib.contextmanager
    def _installed(self, run_id: str):  # type: ignore[no-untyped-def]
        from kfp.local import subprocess_task_handler
        from kfp.local.orchestrator import task_executor

        original_run, original_task = (
            subprocess_task_handler.run_local_subprocess,
            task_executor.execute_single_task,
        )

        def run_process(full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
            return self._run_process(run_id, full_command, env_vars)

        def run_task(task_name: str, task_spec: Any, *args: Any, **kwargs: Any) -> Any:
            return self._run_task(original_task, task_name, task_spec, *args, **kwargs)

        subprocess_task_handler.run_local_subprocess = run_process
        task_executor.execute_single_task = run_task
        try:
            yield
        finally:
            subprocess_task_handler.run_local_subprocess = original_run
            task_executor.execute_single_task = original_task

    def _run_task(self, original: Any, task_name: str, task_spec: Any, *args: Any, **kwargs: Any) -> Any:
        """One task under Argo's rules: no retry from kfp.local; each attempt's end decides the next."""
        from google.protobuf import json_format
        from kfp.local import status

        policy = json_format.MessageToDict(task_spec.retry_policy)
        single = type(task_spec)()
        single.CopyFrom(task_spec)
        single.ClearField("retry_policy")
        exit_handler = task_spec.component_ref.name == EXIT_HANDLER_COMPONENT
        self.local.executor = self.compiled[0]["components"][task_spec.component_ref.name]["executorLabel"]
        self.local.task = task_name
        attempts: list[tuple[float, float]] = []
        while True:
            if self.terminated.is_set() and not exit_handler:  # past the workflow's deadline
                return {}, status.Status.FAILURE
            started = time.monotonic()
            outputs, result = original(task_name, single, *args, **kwargs)
            attempts.append((started, time.monotonic()))
            if result == status.Status.SUCCESS or not policy or self.terminated.is_set():
                return outputs, result
            starts, _ = argo_retry(policy, attempts=attempts, now=attempts[-1][1], phase=self.last_phase,
                                   template_defaults=self.template_defaults)  # fmt: skip
            if starts is None:
                return outputs, result
            if self.terminated.wait((starts - attempts[-1][1]) * self.time_scale):
                return outputs, result

    def _run_process(self, run_id: str, command: list[str], env_vars: dict[str, str] | None) -> int:
        from batchpilot.cluster.eviction import POD_NAME_ENV, POD_NAMESPACE_ENV

        pipeline, platform = self.compiled
        pod = executor_pod(pipeline, platform, self.local.executor, task_path=self.local.task, run_id=run_id)
        pod["metadata"]["generateName"] = f"{run_id[:8]}-{self.local.task}-"
        pod["metadata"]["labels"]["pipeline/runid"] = run_id
        pod["metadata"].setdefault("annotations", {})[EXTERNAL] = "true"
        pod["spec"]["containers"][0]["args"] = list(command)  # what this attempt runs
        created = self.sim.create_pod(TASK_NAMESPACE, pod)
        name, uid = created["metadata"]["name"], created["metadata"]["uid"]
        deadline = time.monotonic() + 60
        while self.sim.pods[(TASK_NAMESPACE, name)]["status"]["phase"] == "Pending":  # the scheduler binds it
            assert time.monotonic() < deadline, (
                f"task pod {name} not scheduled: {self.sim.pods[(TASK_NAMESPACE, name)]['status']}"
            )
            time.sleep(0.05)
        env = {**os.environ, **(env_vars or {}), POD_NAME_ENV: name, POD_NAMESPACE_ENV: TASK_NAMESPACE}
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        task = self.tasks[uid] = _Task(process)
        assert process.stdout is not None
        for line in process.stdout:
            task.lines.append(line)
            print(line, end="")
        code = process.wait()
        with self.sim.lock:
            found = self.sim.pods.get((TASK_NAMESPACE, name))
            deleted = found is None or bool(found["metadata"].get("deletionTimestamp"))
        self.last_phase = "Error" if deleted else ("Succeeded" if code == 0 else "Failed")
        task.code = code  # the kubelet reports the end: the pod ends (and goes, if it was being deleted)
        return code


@dataclass
class TaskProcessKubelet:
    """The simulator's kubelet: task pods' processes are the backend's, every other pod the inner kubelet's."""

    inner: Any
    backend: SimKfpBackend

    @staticmethod
    def _external(pod: dict[str, Any]) -> bool:
        return (pod["metadata"].get("annotations") or {}).get(EXTERNAL) == "true"

    def start(self, pod: dict[str, Any], *, dns_names: set[str]) -> None:
        if not self._external(pod):
            self.inner.start(pod, dns_names=dns_names)

    def stop(self, pod: dict[str, Any], *, grace_s: float) -> None:
        if not self._external(pod):
            return self.inner.stop(pod, grace_s=grace_s)
        task = self.backend.tasks.get(pod["metadata"]["uid"])
        if task is not None and task.code is None:
            task.stop()
        return None

    def poll(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        if not self._external(pod):
            return self.inner.poll(pod)  # type: ignore[no-any-return]
        task = self.backend.tasks.get(pod["metadata"]["uid"])
        return {"exitCode": task.code} if task is not None and task.code is not None else None

    def log(self, pod: dict[str, Any]) -> str:
        if not self._external(pod):
            return self.inner.log(pod)  # type: ignore[no-any-return]
        task = self.backend.tasks.get(pod["metadata"]["uid"])
        return "".join(task.lines) if task is not None else ""

    def stop_all(self) -> None:
        self.inner.stop_all()
