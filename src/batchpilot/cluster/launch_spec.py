"""What a launch's job needs whatever runs it, shared by the GPU/CPU launcher (launch.py) and the TPU one
(tpu_jobset.py): the spec (name, nodes, processes, trainer arguments, environment, labels), the trainer
pod's paths and ports, and the bash wrappers of its command line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from batchpilot.cluster.labels import PLAN_LABEL, RUN_LABEL, STAGE_LABEL
from batchpilot.exitcodes import EXIT_PREEMPTED
from batchpilot.planning.launches import Launch


@dataclass(frozen=True)
class LaunchSpec:
    """What one launch's job needs, independent of the scheduler."""

    name: str
    num_nodes: int
    processes_per_node: int
    trainer_args: tuple[str, ...]
    env: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    """Labels of the cluster job (run, launch, plan): how a retry and the scale-down find it."""
    tpu_topology: str | None = None
    """The TPU slice the launch runs on (one trainer process per host, no torchrun); None: GPU or CPU nodes."""


def stage_launch_spec(
    *,
    run_name: str,
    launch: Launch,
    devices_per_node: int,
    plan_path: str,
    output_dir: str,
    audit: bool = False,
) -> LaunchSpec:
    """The trainer command line and topology of `launch`: `batchpilot train --plan ... --stage A-B`
    (or `--stage K` for one stage): one process group trains the launch's stages in turn."""
    return LaunchSpec(
        name=f"{run_name}-{launch.name}",
        num_nodes=launch.num_nodes,
        processes_per_node=devices_per_node,
        trainer_args=(
            "train",
            "--plan",
            plan_path,
            "--stage",
            launch.stage_arg,
            "--out",
            output_dir,
            *(("--audit",) if audit else ()),
        ),
        env={},
    )


TRAINER_DIR = "/tmp/batchpilot"
"""Inside a trainer pod: where the config and plan are written (the root filesystem is read-only)."""


TRAINER_OUTPUT_DIR = f"{TRAINER_DIR}/out"


RDZV_PORT = 29500


# torchx writes memMB as Kubernetes "M" (10^6 bytes), so bytes convert with the decimal megabyte.
MEGABYTE = 10**6


def _torchrun_shutdown_env() -> dict[str, str]:
    """On SIGTERM torchrun gives its workers 30 s before SIGKILL unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT says
    otherwise (torch.distributed.run `--shutdown-timeout`); let them use the pod's grace period but 10 s."""
    from batchpilot.cluster.placement import TERMINATION_GRACE_S

    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(TERMINATION_GRACE_S - 10)}


def cluster_launch_spec(
    *,
    run_name: str,
    launch: Launch,
    devices_per_node: int,
    plan_text: str,
    audit: bool = False,
) -> LaunchSpec:
    """The launch's spec for pods: the run document travels as an environment variable, written to a file first.

    Its name is the launch's JobSet name (`names.jobset_name`: short, valid and deterministic).

    The launching process (a pipeline task or a laptop) holds the files; pods do not share its disk.
    Metrics and logs under `output_dir` stay in the pod; checkpoints go to `train.checkpoint_uri`.
    """
    from batchpilot.planning.names import jobset_name

    spec = stage_launch_spec(
        run_name=run_name,
        launch=launch,
        devices_per_node=devices_per_node,
        plan_path=f"{TRAINER_DIR}/plan.json",
        output_dir=TRAINER_OUTPUT_DIR,
        audit=audit,
    )
    # Compact JSON: the plan rides in the pod spec, which the API server stores whole.
    compact_plan = json.dumps(json.loads(plan_text), separators=(",", ":"))
    labels = stage_labels(run_name=run_name, stage_name=launch.name, plan_text=compact_plan)
    # The job's name, a valid JobSet name for any run name (the labels, not the name, find it again).
    name = jobset_name(run_name=run_name, launch_name=launch.name)
    if launch.tpu_topology is not None:
        # One trainer process per TPU host drives all its chips (runtime xla): no torchrun, no agent timeout.
        env = {"BATCHPILOT_PLAN_JSON": compact_plan}
        return LaunchSpec(name, spec.num_nodes, 1, spec.trainer_args, env, labels, launch.tpu_topology)
    env = {"BATCHPILOT_PLAN_JSON": compact_plan, **_torchrun_shutdown_env()}
    return LaunchSpec(name, spec.num_nodes, spec.processes_per_node, spec.trainer_args, env, labels)


def stage_labels(*, run_name: str, stage_name: str, plan_text: str) -> dict[str, str]:
    """The run, stage and plan labels of a launch's job; the stage label's value is the launch's name.

    The run is the config's name: the pool, `checkpoint_uri` and the exit handler (which has the config,
    not the plan: it runs when planning failed) are the run's by that name too, so two runs of one config
    cannot train at once anyway. The plan label (a hash of the run document) tells a retry of this run
    from a leftover JobSet of another plan made from the same config (other run-time overrides).
    """
    digest = hashlib.sha256(plan_text.encode()).hexdigest()[:12]
    return {RUN_LABEL: run_name, STAGE_LABEL: stage_name, PLAN_LABEL: digest}


def write_inputs_command() -> str:
    """The start of a trainer pod's bash line: the run document from the environment into a file."""
    return f'mkdir -p {TRAINER_DIR} && printf "%s" "$BATCHPILOT_PLAN_JSON" > {TRAINER_DIR}/plan.json && '


def exit_75_when_preempted(command: str, *, marker: str, program: str = "torchrun") -> str:
    """A trainer pod's bash line `command` (which runs `program`: torchrun, or on TPU hosts the one trainer
    process, `python`) made to exit EXIT_PREEMPTED when the trainers stopped for preemption, i.e. wrote
    `marker`.

    The Job's podFailurePolicy reads the container's exit code (jobset.pod_failure_policy), but torchrun
    exits 1 (143 on SIGTERM) whatever its workers' codes were. torchrun therefore runs through a shell
    function: bash stays PID 1 of the container, which is the process the kubelet sends SIGTERM to
    (Kubernetes "Pod termination"), forwards it to torchrun, waits until torchrun has really ended, then
    turns the trainers' marker into exit 75. The trap is set before the program starts and remembers a
    SIGTERM that came before its process id was known (forwarded as soon as it is): a SIGTERM right after
    the start would otherwise end bash itself (exit 143, no marker), as seen on a loaded machine.
    """
    assert f"{program} " in command, command
    wrapper = (
        f"rm -f {marker}; "
        f"{program}() {{ "
        "child=; term=; trap 'term=1; [ -n \"$child\" ] && kill -TERM $child 2>/dev/null' TERM; "
        f'command {program} "$@" & child=$!; '
        '[ -n "$term" ] && kill -TERM $child 2>/dev/null; '
        "wait $child; code=$?; "
        # wait returns early (128 + signal) when the trap runs; wait again until the program has exited.
        "while kill -0 $child 2>/dev/null; do wait $child; code=$?; done; "
        f"if [ -e {marker} ]; then return {EXIT_PREEMPTED}; fi; "
        "return $code; }; "
    )
    return wrapper + command
