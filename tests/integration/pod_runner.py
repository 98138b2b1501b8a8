"""A kubelet for the cluster simulator that runs each bound pod's container as a local process.

What it does, and the rule behind each part:
- the command is `command + args` with `$(VAR)` references expanded from the container's env
  (kubernetes.io docs "Define a Command and Arguments for a Container": `$(VAR)` expansion);
  a KFP launcher prefix (`/kfp-launcher/launch ... --`) is dropped, the user command after `--` runs;
- the image: a pod's image is this repository's image, which installs this package into Python, so
  `python` / `python3` as the first word runs `sys.executable` (this virtualenv), and any other first
  word is looked up on PATH; `image_commands` maps an image to another argv prefix when needed;
- env: the container's `env` values (`valueFrom.fieldRef` for metadata.name / metadata.namespace /
  spec.nodeName / status.podIP and `metadata.labels['KEY']` / `metadata.annotations['KEY']`, the downward
  API: kubernetes.io docs "Expose Pod Information to Containers Through Environment Variables"), `HOSTNAME` = the pod's hostname, over a minimal
  inherited environment (PATH, HOME, PYTHONPATH, LANG) - nothing else of the test's environment leaks;
- names: pod DNS names `<hostname>.<subdomain>[.<namespace>.svc[.cluster.local]]` (the headless-service
  records of kubernetes.io docs "DNS for Services and Pods") in env values and arguments are rewritten
  to 127.0.0.1, since every pod runs on this machine;
- memory: the resident set of the pod's whole session (every process whose session id is the pod's,
  read from /proc/<pid>/stat and /proc/<pid>/statm) is polled every `poll_s`; above `limits.memory`
  the session is SIGKILLed and the container reports reason OOMKilled, exit code 137 (kubernetes.io
  docs "Assign Memory Resources to Containers": a container over its limit is OOM-killed; 128 + 9);
- deletion: SIGTERM to the session, SIGKILL after `terminationGracePeriodSeconds` (docs "Pod
  Lifecycle", termination of Pods); a signal-killed process reports 128 + the signal number;
- `activeDeadlineSeconds`: the pod is stopped when it has run that long, reason DeadlineExceeded;
- emptyDir volumes (kubernetes.io docs "Volumes": a new empty directory per pod) are folders under
  the pod's folder; their mount paths in the command, args and env values are rewritten to those
  folders (`/tmp/batchpilot/plan.json` -> `<pod folder>/volumes/tmp/batchpilot/plan.json`), so pods on
  this one machine do not share a `/tmp`; PATH starts with this interpreter's bin folder.
- GPUs: a simulated pod sees no GPU, whatever `nvidia.com/gpu` it was given (this machine has none). On
  GKE a container sees its GPUs only through the driver libraries the NVIDIA device plugin mounts at
  /usr/local/nvidia, which the image puts on LD_LIBRARY_PATH (Dockerfile); so here a trainer planned for
  GPUs refuses to start, in one line (batchpilot.train.accelerators), as it would in a pod without the
  driver (tests/integration/test_gpu_refusal_sim.py).

Each pod gets its own folder (cwd and TMPDIR) under `workdir`, with its log in `<pod>.log`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_rules import quantity

LAUNCHER = "/kfp-launcher/launch"
INHERITED = ("PATH", "HOME", "PYTHONPATH", "LANG", "LC_ALL", "VIRTUAL_ENV")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Running:
    process: subprocess.Popen[bytes]
    log_path: Path
    memory_limit_bytes: int | None
    deadline: float | None
    reason: str | None = None  # set when the kubelet killed it (OOMKilled, DeadlineExceeded)
    killer: threading.Timer | None = None


@dataclass
class LocalKubelet:
    workdir: Path
    poll_s: float = 0.05
    image_commands: dict[str, list[str]] = field(default_factory=dict)
    running: dict[str, _Running] = field(default_factory=dict)  # by pod uid
    lock: threading.Lock = field(default_factory=threading.Lock)
    dns_names: set[str] = field(default_factory=set)  # the cluster's pod DNS names, at the last start

    def start(self, pod: dict[str, Any], *, dns_names: set[str]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        self.dns_names = dns_names
        container = spec["containers"][0]
        folder = self.workdir / meta["name"]
        folder.mkdir(parents=True, exist_ok=True)
        mounts = _empty_dirs(spec, container, folder)
        env = {k: _map_paths(v, mounts) for k, v in self._env(pod, container).items()}
        words = list(container.get("command") or []) + list(container.get("args") or [])
        argv = [
            _map_paths(self._localhost(_expand(a, env)), mounts)
            for a in self._localize(words, container["image"])
        ]
        env["TMPDIR"] = str(folder)
        # The image's Python is this virtualenv: its scripts (torchrun, batchpilot) come first on PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        log_path = self.workdir / f"{meta['name']}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        limit = (container.get("resources") or {}).get("limits", {}).get("memory")
        deadline = spec.get("activeDeadlineSeconds")
        running = _Running(
            process=process,
            log_path=log_path,
            memory_limit_bytes=int(quantity(limit)) if limit else None,
            deadline=time.monotonic() + float(deadline) if deadline else None,
        )
        with self.lock:
            self.running[meta["uid"]] = running
        threading.Thread(target=self._watch, args=(running,), daemon=True).start()

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        env = {k: os.environ[k] for k in INHERITED if k in os.environ}
        env["HOSTNAME"] = pod["spec"].get("hostname") or pod["metadata"]["name"]
        fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
                  "spec.nodeName": pod["spec"].get("nodeName", ""), "status.podIP": "127.0.0.1"}  # fmt: skip
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = self._localhost(_expand(str(item["value"]), env))
            elif (ref := (item.get("valueFrom") or {}).get("fieldRef")) and ref["fieldPath"] in fields:
                env[item["name"]] = fields[ref["fieldPath"]]
            elif ref and (
                found := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", ref["fieldPath"])
            ):
                env[item["name"]] = (pod["metadata"].get(found[1]) or {}).get(found[2], "")
        return env

    def _localize(self, argv: list[str], image: str) -> list[str]:
        if argv and argv[0] == LAUNCHER and "--" in argv:
            argv = argv[argv.index("--") + 1 :]
        if image in self.image_commands:
            return self.image_commands[image] + argv[1:]
        if argv and argv[0] in ("python", "python3"):
            return [sys.executable, *argv[1:]]
        return argv

    def _localhost(self, text: str) -> str:
        for name in sorted(self.dns_names, key=len, reverse=True):
            text = re.sub(rf"\b{re.escape(name)}(\.[a-z0-9-]+\.svc(\.cluster\.local)?)?\b", "127.0.0.1", text)
        return text

    def _watch(self, running: _Running) -> None:
        """Polls memory and the deadline until the process ends."""
        while running.process.poll() is None:
            if (
                running.memory_limit_bytes
                and session_rss_bytes(running.process.pid) > running.memory_limit_bytes
            ):
                running.reason = "OOMKilled"
                _signal_session(running.process.pid, signal.SIGKILL)
            elif running.deadline and time.monotonic() > running.deadline and running.reason is None:
                running.reason = "DeadlineExceeded"
                _signal_session(running.process.pid, signal.SIGKILL)
            time.sleep(self.poll_s)

    def stop(self, pod: dict[str, Any], *, grace_s: float) -> None:
        with self.lock:
            running = self.running.get(pod["metadata"]["uid"])
        if running is None or running.process.poll() is not None or running.killer is not None:
            return
        _signal_session(running.process.pid, signal.SIGTERM)
        running.killer = threading.Timer(grace_s, _signal_session, (running.process.pid, signal.SIGKILL))
        running.killer.daemon = True
        running.killer.start()

    def poll(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        with self.lock:
            running = self.running.get(pod["metadata"]["uid"])
        if running is None or (code := running.process.poll()) is None:
            return None
        if running.killer:
            running.killer.cancel()
        exit_code = 128 - code if code < 0 else code  # killed by signal N: 128 + N
        return {"exitCode": exit_code, "reason": running.reason}

    def log(self, pod: dict[str, Any]) -> str:
        with self.lock:
            running = self.running.get(pod["metadata"]["uid"])
        return running.log_path.read_text(errors="replace") if running else ""

    def stop_all(self) -> None:
        """Kills every pod process still running (the end of a test)."""
        with self.lock:
            leftovers = [r for r in self.running.values() if r.process.poll() is None]
        for running in leftovers:
            _signal_session(running.process.pid, signal.SIGKILL)
            running.process.wait(timeout=10)


def session_rss_bytes(session_id: int) -> int:
    """Resident bytes of every process in session `session_id` (fields from /proc, see proc(5))."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == session_id:  # field 6, the session id, after comm
                total += int((entry / "statm").read_text().split()[1]) * PAGE_BYTES
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we read it
    return total


def _signal_session(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it already ended
        os.killpg(pid, sig)


def _empty_dirs(spec: dict[str, Any], container: dict[str, Any], folder: Path) -> list[tuple[str, str]]:
    """(mountPath, local folder) of each emptyDir the container mounts: a fresh folder per pod."""
    empty = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] in empty:
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            mounts.append((mount["mountPath"].rstrip("/"), str(local)))
    return mounts


def _map_paths(text: str, mounts: list[tuple[str, str]]) -> str:
    """Rewrites paths under an emptyDir's mountPath to its local folder (`/tmp/x` -> `<pod>/volumes/tmp/x`)."""
    for mount_path, local in sorted(mounts, key=lambda m: len(m[0]), reverse=True):
        text = re.sub(rf"(?<![\w./-]){re.escape(mount_path)}(?![\w.-])", local, text)
    return text


def _expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` -> its value when defined; `$$(VAR)` -> `$(VAR)` (the escape)."""
    return re.sub(
        r"\$\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: f"$({m.group(1)})" if m.group(1) else env.get(m.group(2), m.group(0)),
        text,
    )
