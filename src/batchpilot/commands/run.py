"""`batchpilot run --local`: compile the pipeline for a config and run all of it on this machine.

The console shows one line when each task starts and ends (with the launch it belongs to: consecutive
stages on one node count, trained by one job), the lines batchpilot's own code logs (explore's probes,
each launch's stages and training lines) and a summary; everything
else kfp.local and the tasks print goes to `pipeline.log` in the run folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Console

from batchpilot.commands.options import add_out
from batchpilot.config import Config, load_config
from batchpilot.errors import BatchpilotError
from batchpilot.files import check_output_dir
from batchpilot.logs import PREFIX

EMBEDDED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
# kfp.local's own lines for a task (colour codes stripped first).
TASK_START = re.compile(r"Executing task '([\w-]+)'")
TASK_END = re.compile(r"Task '([\w-]+)' finished with status ([A-Z]+)")
TASK_RETRY = re.compile(r"Task ([\w-]+) failed \(attempt (\d+)/(\d+)\)\. Retrying in ([\d.]+)s")
TRAINING_STEP = re.compile(r"^\S+ step \d+ \| ")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# Lines of batchpilot's loggers that the task start/end lines already say.
QUIET = ("resized: ", "wrote ", "report: ")
FAILURE_TAIL_LINES = 30
STEP_LINE_INTERVAL_S = 5.0
"""The console shows a stage's training line at most this often (the full log has every one)."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="compile the pipeline and run all of it locally (explore, plan, every stage, report)",
        description="Runs the whole batchpilot pipeline with kfp.local on this machine and leaves the "
        "report, metrics, plan, checkpoints and the full log (pipeline.log) in --out. A config for a "
        "cluster is compiled with `batchpilot compile` and submitted with `batchpilot submit` instead.",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="run with kfp.local on this machine: what `run` always does, so it may be left out",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (default: the embedded demo)",
    )
    add_out(
        parser,
        required=True,
        metavar="DIR",
        help="the folder for the run's report, metrics, plan, checkpoints and log (new or empty, or --resume "
        "or --force)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue a stopped or failed run in its --out folder"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="start over: empty an --out folder that holds a previous run (its pipeline.log) first; a folder "
        "that holds no run is refused even so",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=0,
        help="use this micro batch: explore then measures no other size (and runs only when the study or "
        "the target still needs it); 0: explore",
    )
    parser.set_defaults(handler=run)


class TaskConsole:
    """Turns the pipeline log's lines into the console's: task starts and ends, batchpilot's own lines,
    and a failed task's last lines."""

    def __init__(self, console: Console, *, launch_names: list[str]) -> None:
        self.console = console
        self.launch_names = launch_names
        # Start times per task name, oldest first: a parallel-for's iterations share their task's name.
        self.started: dict[str, list[float]] = {}
        self.task_lines: deque[str] = deque(maxlen=FAILURE_TAIL_LINES)
        self.last_step_line_s = 0.0

    def label(self, task: str) -> str:
        """`train-stage-3` -> `launch-2: train (3/4)` (or the launch's name, `stages-0-2: train (1/2)`, when
        the pipeline names its launches): kfp.local numbers repeated tasks from the second on."""
        match = re.fullmatch(r"(resize-pool|train-stage|bring-next-nodes)(?:-(\d+))?", task)
        if not match:
            return task
        index = int(match.group(2) or 1) - 1
        action = {
            "resize-pool": "resize pool",
            "train-stage": "train",
            "bring-next-nodes": "next launch's nodes",
        }[match.group(1)]
        name = self.launch_names[index] if index < len(self.launch_names) else f"launch-{index}"
        return f"{name}: {action} ({index + 1}/{len(self.launch_names)})"

    def __call__(self, raw: str) -> None:
        line = COLOUR.sub("", raw).rstrip()
        # kfp.local's threads (a parallel-for's iterations) may write two records onto one line: every
        # start and end on it counts.
        starts, ends = TASK_START.findall(line), TASK_END.findall(line)
        for task in starts:
            self.task_lines.clear()
            self.started.setdefault(task, []).append(time.monotonic())
            self.console.print(f"[bold]>[/bold] {self.label(task)}")
        if starts and not ends:
            return
        self.task_lines.append(line)
        if ends:
            for task, status in ends:
                self._ended(task, status)
        elif retry := TASK_RETRY.search(line):
            task, attempt, attempts, delay = retry.groups()
            self._show_task_lines(task)
            self.console.print(
                f"  [yellow]retry[/yellow] {self.label(task)}: attempt {attempt}/{attempts} failed, "
                f"trying again in {float(delay):.0f} s"
            )
        elif PREFIX in line:
            self._batchpilot_line(line.split(PREFIX, 1)[1])

    def _ended(self, task: str, status: str) -> None:
        starts = self.started.get(task) or [time.monotonic()]
        took = time.monotonic() - starts.pop(0)
        if status == "SUCCESS":
            self.console.print(f"  [green]done[/green] {self.label(task)} in {took:.1f} s")
            return
        self._show_task_lines(task)
        self.console.print(f"  [red]{status}[/red] {self.label(task)} after {took:.1f} s")

    def _show_task_lines(self, task: str) -> None:
        self.console.print(f"  last lines of {self.label(task)}:", markup=False)
        for line in self.task_lines:
            self.console.print(f"    | {line}", markup=False)

    def _batchpilot_line(self, text: str) -> None:
        if text.startswith(QUIET):
            return
        if TRAINING_STEP.match(text):
            now = time.monotonic()
            if now - self.last_step_line_s < STEP_LINE_INTERVAL_S:
                return
            self.last_step_line_s = now
        self.console.print(f"    {text}", markup=False)


def run(args: argparse.Namespace) -> int:
    from batchpilot.kfp.local import LOG_NAME, captured_output, run_pipeline
    from batchpilot.kfp.shape import expected_stage_count, pipeline_launch_names

    output = check_output_dir(args.out, field="--out")
    created = not output.exists()
    try:
        config, notes = checked_run_config(args, output)
    except BatchpilotError:
        if created:  # a check may have made the folder: the same command works again once the input is fixed
            shutil.rmtree(output, ignore_errors=True)
        raise
    if args.force and not created:
        _empty(output)  # checked: it holds a previous run (check_local_run)
    num_stages = expected_stage_count(config)
    names = list(pipeline_launch_names(config))
    output.mkdir(parents=True, exist_ok=True)
    log_path = output / LOG_NAME
    console = Console(file=os.fdopen(os.dup(1), "w", buffering=1), highlight=False, soft_wrap=True)
    console.print(
        f"{PREFIX}running pipeline batchpilot-{config.name} locally: explore, plan, {num_stages} stage(s) in "
        f"{_launch_groups(names)}, report -> {output} (full log: {log_path})",
        markup=False,
    )
    for note in notes:
        console.print(f"{PREFIX}{note}", markup=False)
    tasks = TaskConsole(console, launch_names=names)
    started = time.monotonic()
    try:
        with captured_output(log_path, tasks):
            run_pipeline(config, output=output)
    except BatchpilotError:
        if created:  # refused before any task ran: the same command works again once the input is fixed
            shutil.rmtree(output, ignore_errors=True)
        raise
    except RuntimeError as error:
        line = failure_line(str(error), log_path=log_path, config=args.config, output=output)
        _report_failure(console, output, failure=line.removeprefix("batchpilot: error: "))
        print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        line = interrupted_line(config, log_path=log_path, config_arg=args.config, output=output)
        _report_failure(console, output, failure=line.removeprefix("batchpilot: "))
        print(line, file=sys.stderr)
        return 130
    _summary(console, output, elapsed_s=time.monotonic() - started)
    return 0


def checked_run_config(args: argparse.Namespace, output: Path) -> tuple[Config, list[str]]:
    """The local run's config, after every check `plan` and `doctor` make of a local config, so that a
    mistake costs seconds, not a canary and an exploration: the micro batch given, the run folder, the
    ramp, stages, node schedule and memory, the data, the processes this machine can start, credentials
    for a gs:// URI, and the checkpoint folder. Returns the notes to show (what the run changed)."""
    from batchpilot.doctor import run_checks
    from batchpilot.kfp.local import check_local_run, local_run_config

    if args.force and args.resume:
        raise BatchpilotError(
            "--force",
            "cannot go with --resume: --resume continues the run in --out, --force deletes it and starts over",
            "leave out one of them",
        )
    if args.micro_batch_size < 0:
        raise BatchpilotError(
            "--micro-batch-size",
            f"must be a number of samples per device, got {args.micro_batch_size}",
            "give a positive integer, or leave it out to explore",
        )
    loaded = load_config(args.config or str(EMBEDDED_CONFIG))
    config, notes = local_run_config(loaded, output=output, micro_batch_size=args.micro_batch_size)
    check_local_run(config, output, resume=args.resume, force=args.force)
    for check in run_checks(config):
        if check.status == "FAILED" and check.name not in ("plan", "kfp"):  # plan: preflight said it first
            raise BatchpilotError(DOCTOR_FIELDS.get(check.name, check.name), check.message, check.fix)
    return config, notes


def _empty(folder: Path) -> None:
    """Deletes what `folder` holds, keeping the folder (`run --force` on a previous run's folder)."""
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


DOCTOR_FIELDS = {
    "cpus": "cluster",
    "credentials": "credentials",
    "data": "data.uri",
    "checkpoint": "train.checkpoint_uri",
}
"""The config section a failed doctor check of `run` is named by."""


def interrupted_line(config: Config, *, log_path: Path, config_arg: str | None, output: Path) -> str:
    """After Ctrl-C: the exit handler's clean-up done here (the pool scaled down), and the resume command."""
    from batchpilot.workflow.pool import scale_down

    try:
        scale_down(config)
        pool = "the pool was scaled down"
    except Exception as error:  # the line must still say how to resume
        pool = f"scaling the pool down failed ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
    return (
        f"batchpilot: interrupted; {pool}; the full log is {log_path}; to continue: batchpilot run"
        f"{f' --config {config_arg}' if config_arg else ''} --out {output} --resume"
    )


def _report_failure(console: Console, output: Path, *, failure: str) -> None:
    """report.html of a run that failed or was interrupted (what ran, where it stopped, why), when the run
    got far enough to leave something to report from (its plan or its exploration)."""
    from batchpilot.workflow.report import report_failed_run

    if not ((output / "plan.json").is_file() or (output / "explore" / "explore.json").is_file()):
        return
    report = report_failed_run(output, failure=failure)
    if report is not None:
        console.print(f"{PREFIX}report of the stopped run: {report}", markup=False)


def failure_line(message: str, *, log_path: Path, config: str | None, output: Path) -> str:
    """The last line of a failed run: which task failed (kfp.local's words, colour codes removed), where the
    full log is, and the command that continues the run."""
    text = " ".join(COLOUR.sub("", message).split())
    marker = "Inner task failed:"
    where = f"in task {text.split(marker, 1)[1].strip().rstrip('.')}" if marker in text else f"({text})"
    return (
        f"batchpilot: error: the pipeline failed {where}; the exit handler scaled the pool down; "
        f"the full log is {log_path}; to continue: batchpilot run{f' --config {config}' if config else ''} "
        f"--out {output} --resume"
    )


def _launch_groups(names: list[str]) -> str:
    """`launches stages-0-3, stage-4, final`, or `up to 4 launch(es)` for an explored micro batch's slots."""
    if names and all(name.startswith("launch-") for name in names):
        return f"up to {len(names)} launch(es) (their node counts follow from explore, or are decided as the run goes)"
    return f"launches {', '.join(names)}"


def _summary(console: Console, output: Path, *, elapsed_s: float) -> None:
    from batchpilot.plan.rundoc import read_run_document
    from batchpilot.planning.launches import launches
    from batchpilot.runstate import read_metrics

    records = read_metrics(output / "metrics.jsonl")
    plan = read_run_document(output / "plan.json").plan
    groups = [
        f"{launch.name} ("
        + ", ".join(
            f"{s.global_batch_size}@{s.num_nodes}n"
            + (f" of {s.planned_nodes} planned" if s.planned_nodes else "")
            for s in plan.stages[launch.first_stage : launch.last_stage + 1]
        )
        + ")"
        for launch in launches(plan)
    ]
    console.print(
        f"{PREFIX}done in {elapsed_s / 60:.1f} min: micro_batch_size {plan.micro_batches_label()}, "
        f"{len(groups)} launch(es) {' -> '.join(groups)}, {len(records)} steps, "
        f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}",
        markup=False,
    )
    for name in (
        "report.html",
        "plan.json",
        "plan.md",
        "metrics.jsonl",
        "explore/explore.json",
        "ckpt",
        "pipeline.log",
    ):
        console.print(f"{PREFIX}  {output / name}", markup=False)
