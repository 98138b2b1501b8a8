"""Launch a stage's trainers through torchx: one AppDef built from the plan's stage.

The embedded default is torchx's `local_cwd` scheduler: a "node" is a torchrun agent with
`devices_per_node` processes on this machine, all joined over gloo on loopback.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import EXIT_PREEMPTED, PREEMPTED_LOG_MARKER
from batchpilot.planning import Stage


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class LaunchSpec:
    """What one stage's job needs, independent of the scheduler."""

    name: str
    num_nodes: int
    processes_per_node: int
    trainer_args: tuple[str, ...]
    env: dict[str, str]


def stage_launch_spec(
    *,
    run_name: str,
    stage: Stage,
    devices_per_node: int,
    config_path: str,
    plan_path: str,
    output_dir: str,
    audit: bool = False,
) -> LaunchSpec:
    """The trainer command line and topology of `stage`."""
    return LaunchSpec(
        name=f"{run_name}-{stage.name}",
        num_nodes=stage.num_nodes,
        processes_per_node=devices_per_node,
        trainer_args=(
            "train",
            "--config",
            config_path,
            "--plan",
            plan_path,
            "--stage",
            str(stage.index),
            "--output-dir",
            output_dir,
            *(("--audit",) if audit else ()),
        ),
        env={},
    )


def local_appdef(spec: LaunchSpec):
    """A torchx AppDef running `python -m batchpilot train ...` under torchrun on this machine."""
    from torchx.components.dist import torchrun

    env = {
        # torchrun and this interpreter's packages must be found by the replicas.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **spec.env,
    }
    return torchrun(
        *spec.trainer_args,
        m="batchpilot",
        name=spec.name,
        j=f"{spec.num_nodes}x{spec.processes_per_node}",
        env=env,
        rdzv_port=free_port(),
        tee=3,
    )


def run_local(spec: LaunchSpec, *, log_dir: Path) -> int:
    """Runs the job with torchx `local_cwd`, streams its log lines, returns the exit code of the job."""
    from torchx.runner import get_runner
    from torchx.specs import AppState

    appdef = local_appdef(spec)
    runner = get_runner()
    log_dir.mkdir(parents=True, exist_ok=True)
    handle = runner.run(appdef, scheduler="local_cwd", cfg={"log_dir": str(log_dir), "prepend_cwd": True})
    assert isinstance(handle, str)
    print(
        f"[batchpilot] launched {spec.name}: {spec.num_nodes} node(s) x {spec.processes_per_node} process(es) "
        f"via torchx local_cwd ({handle})",
        flush=True,
    )
    role = appdef.roles[0].name
    seen: set[str] = set()
    streams = [
        threading.Thread(target=_stream, args=(runner, handle, role, k, seen), daemon=True)
        for k in range(spec.num_nodes)
    ]
    try:
        for thread in streams:
            thread.start()
        status = runner.wait(handle, wait_interval=0.5)
        for thread in streams:
            thread.join(timeout=10)
    except KeyboardInterrupt:
        runner.cancel(handle)
        raise
    finally:
        runner.close()
    if status is None:
        raise BatchpilotError(spec.name, "torchx lost track of the job", f"see the logs under {log_dir}")
    if status.state == AppState.SUCCEEDED:
        return 0
    if PREEMPTED_LOG_MARKER in seen:
        print(
            f"[batchpilot] {spec.name} was preempted after checkpointing: exit {EXIT_PREEMPTED}", flush=True
        )
        return EXIT_PREEMPTED
    print(
        f"[batchpilot] {spec.name} failed ({status.state}); logs under {log_dir}", file=sys.stderr, flush=True
    )
    return 1


def _stream(runner, handle: str, role: str, replica: int, seen: set[str]) -> None:
    """Copies one node's log lines to stdout as they come, noting the preemption marker."""
    for line in runner.log_lines(handle, role_name=role, k=replica, should_tail=True):
        if PREEMPTED_LOG_MARKER in line:
            seen.add(PREEMPTED_LOG_MARKER)
        print(line, end="" if line.endswith("\n") else "\n", flush=True)
