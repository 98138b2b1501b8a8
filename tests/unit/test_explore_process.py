"""The probe process runner (timeouts, crashes, a probe of several ranks) and how a probe is laid out."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from batchpilot.explore.process import run_ranks
from batchpilot.explore.records import (
    RESULT_MARKER,
    ProbeLayout,
    ProbeRequest,
    merge_ranks,
    pair_ratios,
    probe_layout,
)


@pytest.fixture
def child_module(tmp_path, monkeypatch):
    def write(body: str) -> str:
        (tmp_path / "fake_probe.py").write_text(textwrap.dedent(body))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
        return "fake_probe"

    return write


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hanging_probe_is_killed_at_its_timeout(child_module):
    module = child_module("import time\ntime.sleep(60)\n")
    ranks = run_ranks(module=module, payload="{}", timeout_s=1.0)
    assert ranks.results == {} and ranks.reason.startswith("timed out after 1 s (explore.probe_timeout_s)")


def test_a_crashing_probe_reports_its_last_error_line(child_module):
    module = child_module(
        "import sys\nprint('Traceback ...', file=sys.stderr)\nprint('RuntimeError: bad', file=sys.stderr)\nsys.exit(3)\n"
    )
    ranks = run_ranks(module=module, payload="{}", timeout_s=30)
    assert ranks.results == {} and ranks.reason == "the probe process exited with 3: RuntimeError: bad"


def test_only_the_marked_line_is_the_result(child_module):
    module = child_module(
        f"import sys, json\nprint('model chatter {{\"fits\": false}}')\nprint('{RESULT_MARKER} ' + json.dumps(json.loads(sys.stdin.read())))\n"
    )
    ranks = run_ranks(module=module, payload='{"fits": true}', timeout_s=30)
    assert ranks.results == {0: {"fits": True}} and ranks.reason == ""


def test_a_killed_probe_names_the_signal(child_module):
    module = child_module("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    ranks = run_ranks(module=module, payload="{}", timeout_s=30)
    assert "the probe process was killed by SIGKILL" in ranks.reason


# Each rank writes its pid to a file, then rank 0 reports `fits` from the payload as soon as every rank has
# written its pid (so a slow machine's late start is not taken for a peer that never ran) and rank 1
# reports fitting after a second, or (HANG) never: it waits, as a rank waits in a dead peer's collective.
RANKS = f"""
import json, os, sys, time
from pathlib import Path
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert os.environ["LOCAL_WORLD_SIZE"] == str(world) and os.environ["MASTER_ADDR"] == "127.0.0.1"
Path(os.environ["PIDS"], str(rank)).write_text(str(os.getpid()))
request = json.loads(sys.stdin.read())
if rank == 0:
    while len(os.listdir(os.environ["PIDS"])) < world:
        time.sleep(0.01)
    print("{RESULT_MARKER} " + json.dumps({{"fits": request["fits"], "rank": rank}}), flush=True)
    sys.exit(0)
time.sleep(3600 if request["hang"] else 1)
print("{RESULT_MARKER} " + json.dumps({{"fits": True, "rank": rank}}), flush=True)
"""


def rank_pids(folder) -> list[int]:
    return [int(path.read_text()) for path in sorted(folder.iterdir())]


def test_every_rank_reports_and_reads_the_request(child_module, tmp_path, monkeypatch):
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    ranks = run_ranks(
        module=child_module(RANKS), payload='{"fits": true, "hang": false}', timeout_s=60, processes=2
    )
    assert ranks.results == {0: {"fits": True, "rank": 0}, 1: {"fits": True, "rank": 1}}


def test_a_failing_rank_ends_the_probe_at_once_and_its_waiting_peers_are_killed(
    child_module, tmp_path, monkeypatch
):
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    started = time.monotonic()
    ranks = run_ranks(
        module=child_module(RANKS),
        payload='{"fits": false, "hang": true}',
        timeout_s=60,
        processes=2,
        failed=lambda result: not result["fits"],
    )
    assert time.monotonic() - started < 30
    assert ranks.results == {0: {"fits": False, "rank": 0}} and ranks.reason == ""
    assert len(rank_pids(tmp_path / "pids")) == 2 and not any(map(alive, rank_pids(tmp_path / "pids")))


def test_a_hanging_rank_times_the_whole_probe_out(child_module, tmp_path, monkeypatch):
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    ranks = run_ranks(
        module=child_module(RANKS), payload='{"fits": true, "hang": true}', timeout_s=5, processes=2
    )
    assert ranks.reason == "timed out after 5 s (explore.probe_timeout_s)"
    assert not any(map(alive, rank_pids(tmp_path / "pids")))


def request(processes: int = 2) -> ProbeRequest:
    return ProbeRequest(
        factory="f:g",
        model_args={},
        data_uri="file:///d",
        split="train",
        seq_len=8,
        seed=0,
        verify_checksums=True,
        micro_batch_size=4,
        activation_checkpointing=False,
        compile=False,
        warmup_steps=1,
        timed_steps=2,
        min_timed_s=0.0,
        memory_budget_bytes=2**30,
        parallelism="fsdp",
        processes=processes,
    )


def rank_result(*, fits: bool, peak: int, step_s: float = 0.5, error: str | None = None) -> dict:
    return {
        "micro_batch_size": 4,
        "activation_checkpointing": False,
        "compile": False,
        "fits": fits,
        "peak_memory_bytes": peak,
        "step_time_s": step_s,
        "samples_per_s": 4 / step_s,
        "error": error,
    }


def test_a_probe_of_several_ranks_has_the_largest_peak_and_rank_0s_timing():
    results = {0: rank_result(fits=True, peak=100), 1: rank_result(fits=True, peak=130, step_s=0.6)}
    merged = merge_ranks(request(), results=results, reason="")
    assert (merged.fits, merged.peak_memory_bytes, merged.step_time_s, merged.samples_per_s) == (
        True,
        130,
        0.5,
        8.0,
    )


def test_any_rank_over_its_budget_or_a_crash_means_the_probe_does_not_fit():
    results = {
        0: rank_result(fits=True, peak=100),
        1: rank_result(fits=False, peak=900, error="resident memory 900 bytes exceeded ..."),
    }
    merged = merge_ranks(request(), results=results, reason="")
    assert not merged.fits and merged.peak_memory_bytes == 900
    assert merged.error == "rank 1 of 2: resident memory 900 bytes exceeded ..."
    crashed = merge_ranks(request(), results={0: rank_result(fits=True, peak=100)}, reason="timed out")
    assert (crashed.fits, crashed.error, crashed.peak_memory_bytes) == (False, "timed out", 100)
    assert merge_ranks(request(1), results={}, reason="killed").peak_memory_bytes is None


def test_only_sharded_strategies_run_a_probe_as_a_node_of_processes():
    assert probe_layout(parallelism="ddp", devices_per_node=8) == ProbeLayout("ddp", 1)
    assert probe_layout(parallelism="fsdp", devices_per_node=8) == ProbeLayout("fsdp", 8)
    assert probe_layout(parallelism="hsdp", devices_per_node=2) == ProbeLayout("hsdp", 2)
    assert ProbeLayout("fsdp", 2).line() == "probes run as 2 processes under fsdp (what the stages run)"
    assert "apart from DDP's gradient buckets" in ProbeLayout("ddp", 1).line()
    assert "nothing to shard" in ProbeLayout("fsdp", 1).line()


def test_pair_ratios_compare_samples_per_s_pass_by_pass():
    ratios = pair_ratios(
        times_s=[0.4, 0.5], reference_times_s=[0.1, 0.1], micro_batch_size=8, reference_micro_batch_size=1
    )
    assert ratios == pytest.approx([2.0, 1.6])
