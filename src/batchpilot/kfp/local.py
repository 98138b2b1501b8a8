"""Running the whole pipeline on this machine with kfp.local (the embedded default).

kfp.local's SubprocessRunner runs every task in this Python environment: storage is a local folder, the
node pool is local (a node = a group of processes) and each launch (consecutive stages on one node
count) runs as one torchx `local_cwd` job.
Everything the tasks and kfp.local print goes to a log file in the run folder (`captured_output`); the
caller picks the lines worth showing as they are written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from batchpilot.config import Config, parse_config
from batchpilot.errors import BatchpilotError

LOG_NAME = "pipeline.log"


def _absolute_file_uri(uri: str) -> str:
    if not uri.startswith("file://"):
        return uri
    return f"file://{Path(uri.removeprefix('file://')).absolute()}"


def local_run_config(config: Config, *, output: Path) -> Config:
    """The config of a local run: file URIs made absolute; checkpoints and pool state in the output folder."""
    data = config.model_dump(mode="json")
    data["data"]["uri"] = _absolute_file_uri(data["data"]["uri"])
    data["train"]["checkpoint_uri"] = f"file://{output.absolute()}/ckpt"
    data["cluster"]["pool_state_path"] = str(output.absolute() / "pool.json")
    return parse_config(data)


def check_local_run(config: Config, output: Path, *, resume: bool) -> None:
    """Refuses, before anything runs, a non-local backend, a used output folder and a missing dataset."""
    if config.cluster.backend != "local":
        raise BatchpilotError(
            "cluster.backend",
            f"is {config.cluster.backend!r}; `batchpilot run --local` runs local configs",
            "compile it with `batchpilot compile` and submit it with `batchpilot submit`",
        )
    if output.exists() and any(output.iterdir()) and not resume:
        raise BatchpilotError("--output", f"{output} is not empty", "choose a new folder, or pass --resume")
    from batchpilot.workflow import check_data

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
    pipeline(micro_batch_size=micro_batch_size, run_dir=str(output.absolute()))


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
