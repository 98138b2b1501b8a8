"""Running the whole pipeline on this machine with kfp.local (the embedded default).

kfp.local's SubprocessRunner runs every task in this Python environment: storage is a local folder, the
node pool is local (a node = a group of processes) and each launch (consecutive stages on one node
count) runs as one torchx `local_cwd` job.
Everything the tasks and kfp.local print goes to a log file in the run folder (`captured_output`); the
caller picks the lines worth showing as they are written. The log is kept readable: kfp.local repeats a
warning for every task and prints each task's executor input (the whole config and run document, one JSON
string per line), so each warning is written once and a line longer than `MAX_LOG_LINE_CHARS` is cut, which
leaves the `[batchpilot]` lines findable.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from batchpilot.config import Config, parse_config
from batchpilot.errors import BatchpilotError

LOG_NAME = "pipeline.log"
MAX_LOG_LINE_CHARS = 500
"""A longer line of pipeline.log (an executor payload, a task's output value) keeps this many characters."""


def _absolute_file_uri(uri: str) -> str:
    if not uri.startswith("file://"):
        return uri
    return f"file://{Path(uri.removeprefix('file://')).absolute()}"


def local_run_config(config: Config, *, output: Path, micro_batch_size: int = 0) -> tuple[Config, list[str]]:
    """The config of a local run and what it changed, in words: file URIs made absolute; the pool state,
    and checkpoints on local storage, in the output folder (each run's own: a run never continues another's
    checkpoint); a checkpoint_uri in a bucket is kept. A `micro_batch_size` replaces the config's (explore
    then measures that size only, or is left out when nothing else needs exploring)."""
    data = config.model_dump(mode="json")
    data["data"]["uri"] = _absolute_file_uri(data["data"]["uri"])
    notes: list[str] = []
    configured = data["train"]["checkpoint_uri"]
    if configured.startswith("file://"):
        data["train"]["checkpoint_uri"] = f"file://{output.absolute()}/ckpt"
        notes.append(
            f"train.checkpoint_uri: {configured} -> {data['train']['checkpoint_uri']} (a local run keeps its "
            "checkpoints in its --out folder; a gs:// checkpoint_uri is kept)"
        )
    else:
        notes.append(f"train.checkpoint_uri: {configured} (checkpoints go to the configured bucket)")
    data["cluster"]["pool_state_path"] = str(output.absolute() / "pool.json")
    if micro_batch_size:
        data["batch"]["micro_batch_size"] = micro_batch_size
    return parse_config(data), notes


def check_local_run(config: Config, output: Path, *, resume: bool, force: bool = False) -> None:
    """Refuses, before anything runs, a non-local backend, a used output folder (or a missing one to
    resume; with `force`, one that holds no previous run), a missing dataset, and whatever `plan` would
    refuse (`workflow.plan.preflight`)."""
    if config.cluster.backend != "local":
        raise BatchpilotError(
            "cluster.backend",
            f"is {config.cluster.backend!r}; `batchpilot run --local` runs local configs",
            "compile it with `batchpilot compile` and submit it with `batchpilot submit`",
        )
    if output.exists() and any(output.iterdir()) and not resume and not force:
        raise BatchpilotError(
            "--out",
            f"{output} is not empty (a run in it stopped or failed?)",
            "pass --resume to continue the run in it, --force to start it over, or choose a new folder",
        )
    if force and output.exists() and any(output.iterdir()) and not (output / LOG_NAME).is_file():
        raise BatchpilotError(
            "--out",
            f"{output} is not empty and holds no batchpilot run (no {LOG_NAME}), so --force does not empty it",
            "choose a new folder, or the --out folder of the run to start over",
        )
    if resume and not (output / LOG_NAME).is_file():
        raise BatchpilotError(
            "--resume",
            f"{output} holds no run to continue (no {LOG_NAME})",
            "leave out --resume to start a new run there, or give the --out folder of the run to continue",
        )
    from batchpilot.train.accelerators import planned_gpu, planned_tpu, require_cuda
    from batchpilot.workflow.plan import check_data, preflight

    accelerator = config.cluster.accelerator_type
    if accelerator and planned_gpu(accelerator_type=accelerator):  # as each of its processes would refuse
        try:
            require_cuda(
                accelerator_type=accelerator,
                num_devices_needed=config.cluster.devices_per_node,
                needed_by=f"cluster.devices_per_node={config.cluster.devices_per_node} local process(es) per node",
            )
        except BatchpilotError as error:
            raise BatchpilotError(
                error.field,
                error.problem,
                "leave cluster.accelerator_type out to train on this machine's CPU, or "
                "run where torch sees the GPUs",
            ) from None
    elif planned_tpu(accelerator_type=accelerator):
        raise BatchpilotError(
            "cluster.accelerator_type",
            f"{accelerator} is a TPU, and a local run starts torchrun processes, not the XLA runtime on a TPU host",
            "leave accelerator_type out to run on this machine's CPU, or use backend: gke for a TPU slice",
        )
    preflight(config)  # the ramp, the stages, the node schedule and memory: what `plan` refuses
    check_data(config)  # the shard set and its vocabulary, as `config check` and `plan` check them


def run_pipeline(config: Config, *, output: Path, micro_batch_size: int = 0) -> None:
    """Compiles the pipeline for `config` and runs all of it with kfp.local into `output`.

    Raises:
        RuntimeError: a task failed (the exit handler has scaled the pool down by then).
    """
    from kfp import local

    from batchpilot.kfp.pipeline import build_pipeline

    pipeline = build_pipeline(config)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(output.absolute() / "kfp"))
    printer = builtins.print
    try:
        pipeline(micro_batch_size=micro_batch_size, run_dir=str(output.absolute()))
    finally:
        # kfp.local indents a task's output by swapping `builtins.print` for the task (logging_utils.
        # indented_print) without a lock: two tasks at once (a parallel-for's iterations, as a launch and the
        # task beside it) can leave the swapped one in place, and every later print of this process indented.
        builtins.print = printer


@contextlib.contextmanager
def captured_output(log_path: Path, on_line: Callable[[str], None]) -> Iterator[None]:
    """Sends this process's stdout and stderr (and its children's) to `log_path`; calls `on_line` with
    each line as it is written, from a background thread, and once more for the rest at the end."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    done = threading.Event()
    reader = threading.Thread(target=_follow, args=(log_path, on_line, done), daemon=True)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        reader.start()
        with _tidy_streams():
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)
        done.set()
        reader.join(timeout=10)


@contextlib.contextmanager
def _tidy_streams() -> Iterator[None]:
    """While it lasts, this process's `sys.stdout` and `sys.stderr` cut long lines, and each warning is
    shown once per place it comes from (kfp.local warns once per task, naming the task)."""
    saved = sys.stdout, sys.stderr
    out, err = ShortLines(sys.stdout), ShortLines(sys.stderr)
    seen: set[tuple[type[Warning], str, int]] = set()

    def show_once(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if (category, filename, lineno) in seen:
            return
        seen.add((category, filename, lineno))
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        sys.stderr.write(
            f"{text}\n  (shown once: later warnings from {Path(filename).name}:{lineno} are left out)\n"
        )

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show_once
        sys.stdout, sys.stderr = out, err
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved
            out.end()
            err.end()


class ShortLines(io.TextIOBase):
    """A text stream that passes whole lines on to `stream`, each cut to `MAX_LOG_LINE_CHARS`, and flushes
    them (the console follows pipeline.log as it is written).

    Threads share it (kfp.local runs a parallel-for's iterations in threads that log to one stream): the
    partial line it holds is read and replaced under a lock, so one thread's text never overwrites
    another's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._pending = (self._pending + text).split("\n")
            for line in lines:
                self._stream.write(shorten(line) + "\n")
            # Whole lines reach pipeline.log (a file: block-buffered) at once, and the console with them.
            if lines:
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._stream.flush()

    def end(self) -> None:
        """Writes a last line that had no newline, and flushes."""
        with self._lock:
            if self._pending:
                self._stream.write(shorten(self._pending))
                self._pending = ""
            self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def shorten(line: str) -> str:
    """`line`, or its first `MAX_LOG_LINE_CHARS` characters and how many were left out."""
    if len(line) <= MAX_LOG_LINE_CHARS:
        return line
    return f"{line[:MAX_LOG_LINE_CHARS]} ... [{len(line) - MAX_LOG_LINE_CHARS:,} more characters not logged]"


def _follow(path: Path, on_line: Callable[[str], None], done: threading.Event) -> None:
    with path.open(errors="replace") as file:
        pending = ""
        while True:
            finished = done.is_set()  # read once more after the writer stopped
            chunk = file.read()
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                on_line(line)
            if finished:
                if pending:
                    on_line(pending)
                return
            if not chunk:
                done.wait(0.2)
