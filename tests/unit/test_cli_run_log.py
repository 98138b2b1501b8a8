"""pipeline.log, what `batchpilot run --local` writes: each warning once, long lines cut, batchpilot's own
lines whole, so that they can be found."""

import sys
import warnings

from batchpilot.kfp.local import captured_output


def warn_like_kfp(task: str) -> None:
    """One place warning once per task with the task in its text, as kfp.local's task executor does."""
    warnings.warn(f"Task {task!r}: settings ['display_name'] have no effect", UserWarning, stacklevel=1)


def test_the_log_has_each_warning_once_and_short_lines(tmp_path, monkeypatch):
    # The run's streams write to the file descriptors that captured_output points at the log
    # (pytest's own capture would otherwise take them).
    monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False))  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))  # noqa: SIM115
    log = tmp_path / "pipeline.log"
    seen: list[str] = []
    payload = '"config_yaml": "' + "x" * 5000 + '"'
    with captured_output(log, seen.append):
        for task in ("explore", "plan", "train-stage"):
            warn_like_kfp(task)
        print(f"    {payload}")
        print("    [batchpilot] resized: 0 -> 2 node(s)")
    lines = log.read_text().splitlines()

    (warned,) = [line for line in lines if "UserWarning: Task" in line]  # the first task's, alone
    assert warned.endswith("UserWarning: Task 'explore': settings ['display_name'] have no effect")
    assert "(shown once: later warnings from test_cli_run_log.py:" in log.read_text()
    (cut,) = [line for line in lines if "config_yaml" in line]
    line = f"    {payload}"  # 5,021 characters
    assert cut == line[:500] + " ... [4,521 more characters not logged]"
    assert "    [batchpilot] resized: 0 -> 2 node(s)" in lines
    assert seen == lines  # the console reads what the log holds


def test_each_whole_line_reaches_the_log_file_as_it_is_written(tmp_path):
    """pipeline.log is a file, so the stream over it is block-buffered: `run`'s console, which follows the
    file, would see a task's lines kilobytes late. ShortLines flushes whole lines (a partial one waits)."""
    from batchpilot.kfp.local import ShortLines

    path = tmp_path / "pipeline.log"
    with path.open("w", buffering=8192) as file:
        lines = ShortLines(file)
        lines.write("[batchpilot] stage-0 step 1 | loss 5.4\n[batchpilot] partial")
        assert path.read_text() == "[batchpilot] stage-0 step 1 | loss 5.4\n"
        lines.end()
        assert path.read_text().endswith("[batchpilot] partial")
