"""The rehearsal's checks, in the order a run meets them; each one bounded and one line.

A check that cannot pass leaves those that need it skipped with the reason; the run is terminated and
the rehearsal's folder deleted whatever happened (`Rehearsal.run`'s end).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from batchpilot.cluster.canary import CANARY_NAME
from batchpilot.cluster.labels import STAGE_LABEL
from batchpilot.config import Config, parse_config
from batchpilot.doctor.core import Check, fail, ok, one_line, skip
from batchpilot.errors import BatchpilotError
from batchpilot.rehearse.cluster import (
    ClusterView,
    KfpRuns,
    Pod,
    latest_step,
    pool_size,
    pool_target,
    resumed_from,
    saved_before,
)
from batchpilot.rehearse.shape import Target, rehearsal_config, rehearsal_root

logger = logging.getLogger(__name__)

T = TypeVar("T")
POLL_S = 2.0
RESUMED = re.compile(r"resumed from step (\d+) \(([\d,]+) samples\)")
STEPPING = re.compile(r" step \d+ \| samples ")
"""A trainer's progress line (`train.steps.progress_line`): its process group formed and it trains."""
ENDED_STATES = ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED")


class Waited(Exception):
    """A wait ended without what it waited for; the message says what and for how long."""


def wait_for(what: str, found: Callable[[], T | None], *, timeout_s: float, poll_s: float = POLL_S) -> T:
    """Polls `found` until it returns something; raises `Waited` naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = found()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise Waited(f"no {what} within {timeout_s:g} s")
        time.sleep(poll_s)


@dataclass
class Options:
    """What the command line decides."""

    pool: str
    host: str
    token: str | None = None
    namespace: str | None = None
    kfp_namespace: str = "kubeflow"
    pace_s: float = 0.5
    step_timeout_s: float = 900.0
    keep: bool = False
    rehearsal_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass
class Rehearsal:
    """One rehearsal of `user`'s config on `options.pool`; `run()` yields its lines."""

    user: Config
    options: Options
    config: Config | None = None
    run_id: str | None = None
    jobsets: list[str] = field(default_factory=list)
    provisioned: set[str] = field(default_factory=set)

    def run(self) -> Iterator[Check]:
        """Every check in order, then `wind_down`'s. A check that fails skips the checks after it."""
        steps: list[tuple[str, Callable[[], Check]]] = [
            ("config", self.make_config),
            ("data", self.write_data),
            ("submit", self.submit),
            ("launch", self.first_launch),
            ("checkpoint", self.first_checkpoint),
            ("trainer pod deleted", self.delete_trainer_pod),
            ("stage change", self.stage_change),
            ("train task pod deleted", self.delete_train_task_pod),
        ]
        failed: str | None = None
        for name, step in steps:
            if failed is not None:
                yield skip(name, f"{failed} did not pass")
                continue
            check = self._bounded(name, step)
            if check.status == "FAILED":
                failed = name
            yield check
        yield from self.wind_down()

    def wind_down(self) -> Iterator[Check]:
        """Whatever happened before (Ctrl-C included): the run terminated and checked, the folder deleted."""
        yield self._bounded("terminate", self.terminate)
        yield self._bounded("provisioning request", self.provisioning_round_trip)
        yield self._bounded("clean up", self.clean_up)

    def _bounded(self, name: str, step: Callable[[], Check]) -> Check:
        try:
            return step()
        except Waited as waited:
            return fail(
                name, str(waited), "see the run in the KFP UI and the pods' events (`kubectl describe`)"
            )
        except BatchpilotError as error:
            return fail(
                name, one_line(f"{error.field}: {error.problem}"), error.fix or f"correct {error.field}"
            )
        except Exception as error:  # an API's refusal, an unreachable endpoint: a line, never a traceback
            return fail(name, f"{type(error).__name__}: {one_line(str(error))[:300]}",
                        "see the message; rerun with --keep to read what the run left")  # fmt: skip

    # -- before the run ------------------------------------------------------------------------------

    def make_config(self) -> Check:
        from batchpilot.kfp.pipeline import STAGE_BACKOFF_S
        from batchpilot.plan.checks import check_plan_config

        cluster = self.user.cluster
        pool = pool_target(cluster, self.options.pool)
        accelerators = list(pool.config.accelerators)
        target = Target(
            pool=self.options.pool,
            machine_type=str(pool.config.machine_type),
            accelerator_type=str(accelerators[0].accelerator_type) if accelerators else None,
            devices_per_node=int(accelerators[0].accelerator_count) if accelerators else 1,
            idle_nodes=pool_size(cluster.model_copy(update={"node_pool": self.options.pool})),
        )
        data = rehearsal_config(
            self.user.model_dump(mode="json"), target=target, rehearsal_id=self.options.rehearsal_id,
            pace_s=self.options.pace_s, retry_backoff_s=STAGE_BACKOFF_S,
        )  # fmt: skip
        self.config = parse_config(data)
        check_plan_config(self.config)  # every problem of the derived config, before anything is written
        devices = (
            f"{target.devices_per_node} x {target.accelerator_type}" if target.accelerator_type else "CPU"
        )
        return ok(
            "config",
            f"run {self.config.name} on pool {target.pool} ({target.machine_type}, {devices}; {target.idle_nodes} "
            f"node(s) now), stages on 1 then 2 node(s), {self.options.pace_s:g} s a step; data and checkpoints "
            f"under {self.root}",
        )

    @property
    def root(self) -> str:
        assert self.config is not None
        return rehearsal_root(self.user.train.checkpoint_uri, self.options.rehearsal_id)

    def write_data(self) -> Check:
        from batchpilot.data.corpora import text_sources
        from batchpilot.data.prepare import demo_inputs, prepare
        from batchpilot.data.tokenizers import load_tokenizer

        assert self.config is not None

        manifest = prepare(
            inputs=text_sources(demo_inputs()[:40]), out_uri=self.config.data.uri,
            tokenizer=load_tokenizer(None), shard_size_tokens=1_000_000, validation_fraction=0.0,
            workers=1, show_progress=False,
        )  # fmt: skip
        tokens = sum(manifest.num_tokens(split) for split in manifest.splits)
        return ok(
            "data", f"{self.config.data.uri}: {tokens:,} tokens (the standard library's first 40 files)"
        )

    def submit(self) -> Check:
        import tempfile
        from pathlib import Path

        import yaml

        from batchpilot.kfp.submit import prepare_request, submit

        assert self.config is not None
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "config.yaml"
            path.write_text(yaml.safe_dump(self.config.model_dump(mode="json")))
            request = prepare_request(
                config_path=str(path), host=self.options.host, experiment="batchpilot-rehearsals",
                run_name=self.config.name, service_account=None, namespace=self.options.namespace,
                pipeline_name=None, pipeline_version=None, image=None, param_pairs=(),
                uses_token=self.options.token is not None,
            )  # fmt: skip
        result = submit(request, token=self.options.token)
        self.run_id = result.run_id
        return ok("submit", f"run {result.run_id} ({result.run_url})")

    # -- watching it -------------------------------------------------------------------------------

    @property
    def view(self) -> ClusterView:
        assert self.config is not None
        return ClusterView(self.config.cluster, kfp_namespace=self.options.kfp_namespace)

    def _note_requests(self, view: ClusterView) -> None:
        from batchpilot.cluster.objects import is_true

        assert self.config is not None
        if self.config.cluster.provisioning == "flex-start":
            for request in view.provisioning_requests(self.config.name):
                if is_true(request, "Provisioned"):
                    self.provisioned.add(request["metadata"]["name"])

    def _running_jobset(
        self, view: ClusterView, *, exclude: tuple[str, ...] = ()
    ) -> tuple[str, list[Pod]] | None:
        """A JobSet of the run (not in `exclude`) whose pods all run, with its pods."""
        assert self.config is not None
        self._note_requests(view)
        self._check_run_alive()
        for item in view.jobsets(self.config.name):
            name = item["metadata"]["name"]
            if name in exclude or (item["metadata"].get("labels") or {}).get(STAGE_LABEL) == CANARY_NAME:
                continue
            pods = [p for p in view.trainer_pods(name) if not p.deleting]
            if pods and all(p.phase == "Running" for p in pods):
                return name, pods
        return None

    def _check_run_alive(self) -> None:
        assert self.run_id is not None
        state = self._runs().state(self.run_id)
        if state in ENDED_STATES:
            raise BatchpilotError("the run", f"ended {state} before the rehearsal saw what it waits for",
                                  "see the run in the KFP UI")  # fmt: skip

    def _runs(self) -> KfpRuns:
        return KfpRuns(host=self.options.host, token=self.options.token, namespace=self.options.namespace)

    def first_launch(self) -> Check:
        view, started = self.view, time.monotonic()
        name, pods = wait_for(
            "JobSet of the run with every pod Running", lambda: self._running_jobset(view),
            timeout_s=self.options.step_timeout_s,
        )  # fmt: skip
        self.jobsets.append(name)
        wait_for(f"training step in the logs of JobSet {name}'s {len(pods)} pod(s) (the rendezvous done)",
                 lambda: logged(view, pods, STEPPING), timeout_s=self.options.step_timeout_s)  # fmt: skip
        return ok(
            "launch",
            f"JobSet {name}: {len(pods)} pod(s) Running and stepping (the process group formed) "
            f"{time.monotonic() - started:.0f} s after the submit",
        )

    def first_checkpoint(self) -> Check:
        assert self.config is not None
        uri = self.config.train.checkpoint_uri
        step = wait_for(
            f"checkpoint under {uri}", lambda: latest_step(uri), timeout_s=self.options.step_timeout_s
        )
        return ok("checkpoint", f"step {step} committed under {uri}")

    def delete_trainer_pod(self) -> Check:
        assert self.config is not None
        view, jobset = self.view, self.jobsets[-1]
        uri = self.config.train.checkpoint_uri
        pods = [p for p in view.trainer_pods(jobset) if p.restart_attempt == "0" and not p.deleting]
        if not pods:
            return fail("trainer pod deleted", f"JobSet {jobset} has no pod of its first attempt left",
                        "the stage ended before the rehearsal could disturb it: lower --pace-s's speed-up")  # fmt: skip
        step = latest_step(uri)
        view.delete_pod(pods[0].name)
        at, how = wait_for(
            f"resume of JobSet {jobset}'s next attempt (a resume line in its pods' logs, or a save of theirs)",
            lambda: self._resume_point(jobset, uri), timeout_s=self.options.step_timeout_s,
        )  # fmt: skip
        # The restart resumes from the last save of the attempt it replaces (its SIGTERM save, else the one
        # before the delete). Saves after the resume point are the restarted trainers' own unless their meta
        # says a trainer that started earlier wrote them: the restart then skipped a newer checkpoint. (The
        # newest step alone cannot tell: the restarted trainers may have saved again before it is read.)
        skipped = saved_before(uri, after_step=at)
        if at < (step or 0) or skipped:
            return fail(
                "trainer pod deleted",
                f"deleted pod {pods[0].name} at checkpoint step {step}; the restart resumed from step {at}"
                + (f", not from step {max(skipped)} its predecessor saved" if skipped else ""),
                "a restart must resume from the last committed checkpoint: report it",
            )  # fmt: skip
        return ok(
            "trainer pod deleted",
            f"deleted pod {pods[0].name} after step {step}'s checkpoint; JobSet {jobset} restarted and resumed "
            f"from step {at} ({how}), the last checkpoint committed (the trainers save one on SIGTERM)",
        )

    def _resume_point(self, jobset: str, uri: str) -> tuple[int, str] | None:
        """Where the restarted trainers resumed from: their resume line while their pods are there (Running,
        or done already: the stage's rest can end between two polls), else the meta of a save of theirs (the
        JobSet may be gone with its pods by then)."""
        restarted = [p for p in self.view.trainer_pods(jobset) if p.restart_attempt != "0"]
        match = logged(self.view, restarted, RESUMED)
        if match is not None:
            return int(match.group(1)), f"{match.group(2)} samples, a restarted pod's log"
        step = resumed_from(uri)
        return None if step is None else (step, "the meta of the restarted trainers' saves")

    def stage_change(self) -> Check:
        view = self.view
        name, pods = wait_for(
            "next launch's JobSet with every pod Running",
            lambda: self._running_jobset(view, exclude=tuple(self.jobsets)), timeout_s=self.options.step_timeout_s,
        )  # fmt: skip
        self.jobsets.append(name)
        # Rank 0 logs it, and torchrun's c10d rendezvous numbers the nodes in the order they join: any pod.
        resumed = wait_for(
            f"resume line in the logs of JobSet {name}'s {len(pods)} pod(s)",
            lambda: logged(view, pods, RESUMED), timeout_s=self.options.step_timeout_s,
        )  # fmt: skip
        return ok(
            "stage change",
            f"JobSet {name} on {len(pods)} node(s) resumed from step {resumed.group(1)} ({resumed.group(2)} "
            "samples), where the first launch ended",
        )

    def delete_train_task_pod(self) -> Check:
        assert self.run_id is not None and self.config is not None
        view, jobset = self.view, self.jobsets[-1]
        task = wait_for(
            "running train task pod of the run", lambda: [p for p in view.train_task_pods(self.run_id or "")
                                                         if p.phase == "Running" and not p.deleting],
            timeout_s=self.options.step_timeout_s,
        )[0]  # fmt: skip
        view.delete_pod(task.name, namespace=self.options.kfp_namespace)
        runs, started = self._runs(), time.monotonic()

        def outcome() -> str | None:
            if runs.state(self.run_id or "") in ENDED_STATES:
                return "ended"
            retry = [
                p
                for p in view.train_task_pods(self.run_id or "")
                if p.name != task.name and p.phase == "Running"
            ]
            if retry and "adopting its running JobSet" in view.log(
                retry[0].name, namespace=self.options.kfp_namespace
            ):
                return retry[0].name
            return None

        found = wait_for(f"retry adopting JobSet {jobset}, nor the run's end, after deleting the train task's pod "
                         f"{task.name}", outcome, timeout_s=self.options.step_timeout_s)  # fmt: skip
        if found == "ended":
            return fail(
                "train task pod deleted",
                f"deleted the train task's pod {task.name}: Argo did not retry it and the run ended "
                f"{runs.state(self.run_id)}",
                "let Argo retry a task whose pod was deleted (batchpilot doctor's argo retries; docs/cluster.md, "
                '"Argo retries")',
            )  # fmt: skip
        alive = [j["metadata"]["name"] for j in view.jobsets(self.config.name)]
        if jobset not in alive:
            return fail("train task pod deleted", f"JobSet {jobset} is gone after its task's pod was deleted",
                        "an evicted train task must leave its JobSet for the retry: report it")  # fmt: skip
        return ok(
            "train task pod deleted",
            f"deleted the train task's pod {task.name}; Argo retried it {time.monotonic() - started:.0f} s later and "
            f"the retry ({found}) adopted the running JobSet {jobset}",
        )

    # -- the end -----------------------------------------------------------------------------------

    def terminate(self) -> Check:
        if self.run_id is None or self.config is None:
            return skip("terminate", "no run was submitted")
        runs, view, started = self._runs(), self.view, time.monotonic()
        name = self.config.name
        if runs.state(self.run_id) not in ENDED_STATES:
            runs.terminate(self.run_id)
        state = wait_for("end of the terminated run", lambda: (s := runs.state(self.run_id or "")) in ENDED_STATES and s,
                         timeout_s=self.options.step_timeout_s)  # fmt: skip
        wait_for(f"end of run {name}'s JobSets", lambda: not view.all_jobsets(name) or None,
                 timeout_s=self.options.step_timeout_s)  # fmt: skip
        self._note_requests(view)
        wait_for(f"end of run {name}'s ProvisioningRequests", lambda: not view.provisioning_requests(name) or None,
                 timeout_s=self.options.step_timeout_s)  # fmt: skip
        idle = self.config.cluster.idle_nodes
        wait_for(f"pool {self.options.pool} back at {idle} node(s) (the exit handler's scale-down)",
                 lambda: pool_size(self.config.cluster) == idle if self.config else None,
                 timeout_s=self.options.step_timeout_s)  # fmt: skip
        wait_for(f"deletion of run {name}'s Lease (the exit handler's last step)",
                 lambda: not view.lease_held(name) or None, timeout_s=self.options.step_timeout_s)  # fmt: skip
        return ok(
            "terminate",
            f"terminated from KFP: the run ended {state} in {time.monotonic() - started:.0f} s; its JobSets and "
            f"ProvisioningRequests are gone, the exit handler scaled {self.options.pool} to {idle} node(s) and "
            "released it",
        )

    def provisioning_round_trip(self) -> Check:
        if self.config is None or self.config.cluster.provisioning != "flex-start":
            return skip("provisioning request", "cluster.provisioning is not flex-start")
        if self.run_id is None:
            return skip("provisioning request", "no run was submitted")
        if not self.provisioned:
            return fail("provisioning request", "no ProvisioningRequest of the run was seen Provisioned",
                        "see the run's train task log for what GKE said")  # fmt: skip
        return ok("provisioning request", f"{', '.join(sorted(self.provisioned))} Provisioned, then deleted")

    def clean_up(self) -> Check:
        from batchpilot.storage import open_storage

        if self.config is None:
            return skip("clean up", "nothing was written")
        if self.options.keep:
            return skip("clean up", f"--keep: {self.root} is left for you to read")
        storage = open_storage(self.root)
        names = storage.list()
        for name in names:
            storage.delete(name)
        return ok("clean up", f"deleted {len(names)} object(s) under {self.root}")


def summary(checks: list[Check]) -> str:
    counts = {
        status: sum(1 for c in checks if c.status == status) for status in ("passed", "FAILED", "skipped")
    }
    return f"rehearse: {counts['passed']} passed, {counts['FAILED']} FAILED, {counts['skipped']} skipped"


def logged(view: ClusterView, pods: Sequence[Pod], pattern: re.Pattern[str]) -> re.Match[str] | None:
    """`pattern`'s first match in the logs of `pods`, in their order (None: in none yet)."""
    for pod in pods:
        match = pattern.search(view.log(pod.name))
        if match:
            return match
    return None
