"""The canary's rank: what every trainer of the run will need, checked and measured in a short job.

One process per planned device, under torchrun on the first launch's nodes (`batchpilot canary-rank`):

1. the planned devices are visible (`accelerators.require_planned_accelerator`, as a trainer checks);
2. the process group forms within `CANARY_TIMEOUT_S` (nccl on GPUs, gloo on CPUs);
3. per node: a loading host reads a range of the training shards through the shard layer (MB/s), and one
   process writes, reads back and deletes an object under `<train.checkpoint_uri>/canary/`;
4. one all-reduce across all ranks, after a warm-up, timed over a few iterations: its bus bandwidth
   (nccl-tests: bytes x 2(n-1)/n / time) next to the machine's expected figure (from the spec);
5. on GPUs, NCCL's version and the network transport each rank's NCCL chose, read from NCCL's own debug
   log (`cluster.canary.NCCL_DEBUG_ENV`, set on the canary's GPU pods).

The canary fails, after rank 0 wrote canary.json with the figures, when the bus bandwidth is below half the
expected figure or when NCCL fell back to its Socket transport although the pods are set up for GPUDirect:
a silent fallback to TCP over the primary NIC runs at a quarter of TCPX's figure and an eighth of TCPXO's.

Rank 0 gathers every rank's result and writes `canary.json` beside the probes. Any failure ends every
rank with exit 1 and one line, `CANARY_FAILED_MARKER ...`, naming what failed and where (node, rank, host, URI);
the task that launched the job reads that line (`failure_line`). The arithmetic and the verdicts are pure
functions, tested without torch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchpilot.errors import BatchpilotError
from batchpilot.exitcodes import CANARY_FAILED_MARKER
from batchpilot.runstate import CANARY_FILE, write_canary

CANARY_TIMEOUT_S = 300
"""Bound on the process group forming and on each collective: a node that never joins fails the canary."""
MIN_BANDWIDTH_FRACTION = 0.5
"""Below this share of the expected bus bandwidth the canary fails: a healthy fabric gives 70-90 % under
nccl-tests, while NCCL's fallback to TCP over the primary NIC gives 25 % of an A3's TCPX figure (200 of 800
Gbps) and 12.5 % of an A3 Mega's TCPXO figure (200 of 1600 Gbps): half leaves room for noise and catches
both."""
NCCL_NETWORK_LINE = "NCCL INFO Using network "
"""The line NCCL's init logs (INIT|NET) once it has picked its network transport: `Socket` and `IB` are
NCCL's own (src/transport/net_socket.cc, net_ib.cc), a net plugin's name otherwise (GPUDirect-TCPX/TCPXO)."""
SOCKET_NETWORK = "Socket"
WARMUP_ITERATIONS = 2
TIMED_ITERATIONS = 5
ALL_REDUCE_BYTES = {"nccl": 256 * 2**20, "gloo": 4 * 2**20}
"""Per backend: large enough on GPUs to reach the fabric's bandwidth, small on CPUs so a local canary
takes well under a second."""
READ_BYTES = {"nccl": 64 * 2**20, "gloo": 4 * 2**20}
"""Bytes of training tokens each loading host reads (capped by the shard set's size)."""
PROBE_BYTES = 2**20
"""The object each node writes and reads back under the checkpoint URI."""


def bus_bandwidth_bytes_per_s(*, num_bytes: int, world_size: int, time_s: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: `num_bytes x 2(n-1)/n / time_s` (0 on one rank, where
    nothing moves)."""
    if time_s <= 0:
        raise ValueError(f"time_s must be positive, got {time_s}")
    return num_bytes * 2 * (world_size - 1) / world_size / time_s


def bandwidth_problem(*, measured: float, expected: float | None, machine: str | None) -> str | None:
    """Why the canary fails when the bus bandwidth is below MIN_BANDWIDTH_FRACTION of the expected figure;
    None when it is not, or when there is nothing to compare with."""
    if expected is None or measured >= MIN_BANDWIDTH_FRACTION * expected:
        return None
    between = f" between {machine} nodes" if machine else ""
    return (
        f"all-reduce bus bandwidth {measured / 1e9:.2f} GB/s is {measured / expected:.0%} of the "
        f"{expected / 1e9:.0f} GB/s expected{between} (below {MIN_BANDWIDTH_FRACTION:.0%}): "
        "check the nodes' GPU NICs and GPUDirect set-up (docs/cluster.md) before a long run"
    )


def nccl_network(log_text: str) -> str | None:
    """The network transport NCCL's debug log says it uses (None: no such line)."""
    for line in log_text.splitlines():
        if NCCL_NETWORK_LINE in line:
            return line.split(NCCL_NETWORK_LINE, 1)[1].strip() or None
    return None


def transport_problem(results: list[RankResult], *, gpudirect: str | None) -> str | None:
    """Why the canary fails when a rank's NCCL uses its Socket transport although the pods carry the
    `gpudirect` stack (its GKE title); None otherwise, or without GPUDirect."""
    if gpudirect is None:
        return None
    fallen = [r for r in results if r.nccl_network == SOCKET_NETWORK]
    if not fallen:
        return None
    nodes = sorted({r.node for r in fallen})
    return (
        f"NCCL uses its {SOCKET_NETWORK} transport (TCP over the primary NIC) on node(s) "
        f"{', '.join(map(str, nodes))} although the pods are set up for {gpudirect}: its net plugin did not load "
        "(check the NCCL plugin installer DaemonSet, the pods' GPU NIC networks and the plugin's library path; "
        "docs/cluster.md, GPUDirect)"
    )


@dataclass
class RankResult:
    """What one rank found; `error` set means it failed there."""

    rank: int
    node: int
    local_rank: int
    host: str
    devices: int
    """Devices this process sees (CUDA devices; on CPUs, 0)."""
    read_bytes: int = 0
    read_s: float = 0.0
    checkpoint_write_ms: float | None = None
    checkpoint_read_ms: float | None = None
    nccl_network: str | None = None
    """The network transport this rank's NCCL chose (GPUs only; None when its log did not say)."""
    error: str | None = None
    started_at: float = field(default_factory=time.time, compare=False)  # unix s: the run report's wall time


def failure_line(result: RankResult) -> str:
    """The one line that says what failed and where."""
    return (
        f"{CANARY_FAILED_MARKER} node {result.node} (rank {result.rank}, host {result.host}): {result.error}"
    )


@dataclass
class Summary:
    """canary.json: the job's shape and its figures, one entry per node."""

    num_nodes: int
    processes_per_node: int
    world_size: int
    backend: str
    machine_type: str | None
    data_uri: str
    checkpoint_uri: str
    all_reduce_bytes: int
    all_reduce_time_s: float
    bus_bandwidth_bytes_per_s: float
    expected_bus_bandwidth_bytes_per_s: float | None
    bandwidth_problem: str | None
    nccl_version: str | None = None
    nccl_networks: list[str] = field(default_factory=list)
    transport_problem: str | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def problem(self) -> str | None:
        """Why the canary fails on its figures (the transport first: it explains a low bandwidth)."""
        return self.transport_problem or self.bandwidth_problem


def summarize(
    results: list[RankResult],
    *,
    spec: dict[str, Any],
    backend: str,
    all_reduce_bytes: int,
    time_s: float,
    nccl_version: str | None = None,
) -> Summary:
    """canary.json from every rank's result and the all-reduce's timing (pure)."""
    world_size = len(results)
    measured = bus_bandwidth_bytes_per_s(num_bytes=all_reduce_bytes, world_size=world_size, time_s=time_s)
    expected = spec.get("expected_bus_bandwidth_bytes_per_s")
    machine = spec["config"]["cluster"].get("machine_type")
    nodes = []
    for node in sorted({r.node for r in results}):
        ranks = [r for r in results if r.node == node]
        read_bytes, read_s = sum(r.read_bytes for r in ranks), max(r.read_s for r in ranks)
        writes = [r for r in ranks if r.checkpoint_write_ms is not None]
        nodes.append(
            {
                "node": node,
                "host": ranks[0].host,
                "devices": max(r.devices for r in ranks),
                "processes": len(ranks),
                "read_bytes": read_bytes,
                "read_mb_per_s": read_bytes / 1e6 / read_s if read_s > 0 else None,
                "checkpoint_write_ms": writes[0].checkpoint_write_ms if writes else None,
                "checkpoint_read_ms": writes[0].checkpoint_read_ms if writes else None,
            }
        )
    config = spec["config"]
    return Summary(
        num_nodes=len(nodes), processes_per_node=world_size // max(len(nodes), 1), world_size=world_size,
        backend=backend, machine_type=machine, data_uri=config["data"]["uri"],
        checkpoint_uri=config["train"]["checkpoint_uri"], all_reduce_bytes=all_reduce_bytes,
        all_reduce_time_s=time_s, bus_bandwidth_bytes_per_s=measured,
        expected_bus_bandwidth_bytes_per_s=expected,
        bandwidth_problem=bandwidth_problem(measured=measured, expected=expected, machine=machine),
        nccl_version=nccl_version,
        nccl_networks=sorted({r.nccl_network for r in results if r.nccl_network}),
        transport_problem=transport_problem(results, gpudirect=_gpudirect_title(config["cluster"])),
        nodes=nodes,
    )  # fmt: skip


def _gpudirect_title(cluster: dict[str, Any]) -> str | None:
    from batchpilot.planning.gpudirect import gpudirect_stack

    stack = gpudirect_stack(
        gpudirect=cluster.get("gpudirect", "auto"), machine_type=cluster.get("machine_type")
    )
    return stack.title if stack is not None else None


def canary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """canary.json's headline figures for KFP's metrics (bandwidths in GB/s, reads in MB/s)."""
    nodes = summary["nodes"]
    metrics = {
        "num_nodes": float(summary["num_nodes"]),
        "world_size": float(summary["world_size"]),
        "bus_bandwidth_gb_per_s": summary["bus_bandwidth_bytes_per_s"] / 1e9,
    }
    if summary.get("expected_bus_bandwidth_bytes_per_s"):
        metrics["expected_bus_bandwidth_gb_per_s"] = summary["expected_bus_bandwidth_bytes_per_s"] / 1e9
    reads = [n["read_mb_per_s"] for n in nodes if n.get("read_mb_per_s") is not None]
    if reads:
        metrics["min_read_mb_per_s"] = min(reads)
    for key in ("checkpoint_write_ms", "checkpoint_read_ms"):
        values = [n[key] for n in nodes if n.get(key) is not None]
        if values:
            metrics[f"max_{key}"] = max(values)
    return metrics


def summary_line(summary: dict[str, Any]) -> str:
    """One log line for canary.json."""
    expected = summary.get("expected_bus_bandwidth_bytes_per_s")
    versus = f" (expected ~{expected / 1e9:.0f} GB/s)" if expected else ""
    if summary.get("nccl_version"):
        networks = ", ".join(summary.get("nccl_networks") or []) or "not logged"
        versus += f", NCCL {summary['nccl_version']} over {networks}"
    reads = ", ".join(
        f"{n['read_mb_per_s']:.0f}" for n in summary["nodes"] if n.get("read_mb_per_s") is not None
    )
    writes = ", ".join(
        f"{n['checkpoint_write_ms']:.0f}/{n['checkpoint_read_ms']:.0f}"
        for n in summary["nodes"]
        if n.get("checkpoint_write_ms") is not None
    )
    return (
        f"canary: {summary['num_nodes']} node(s) x {summary['processes_per_node']} process(es) passed: "
        f"{summary['backend']} all-reduce {summary['bus_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s bus bandwidth"
        f"{versus}; shards read {reads or '-'} MB/s per loading node; checkpoint write/read {writes} ms per node"
    )


def read_spec(path: str) -> dict[str, Any]:
    """The canary's spec: `config` (the run's config as JSON), `num_nodes`, `result_uri` and
    `expected_bus_bandwidth_bytes_per_s` (null: no figure)."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise BatchpilotError("--spec", f"cannot read {path}: {error}") from None
    missing = [key for key in ("config", "num_nodes", "result_uri") if key not in spec]
    if missing:
        raise BatchpilotError(
            "--spec", f"{path} lacks {', '.join(missing)}", "give the spec the canary task wrote"
        )
    return spec


# --- the job: torch from here on ------------------------------------------------------------------


def run_canary(spec: dict[str, Any]) -> int:
    """This rank's part of the canary; returns 0, or 1 after printing the one failure line."""
    from batchpilot.config import parse_config, resolved_runtime
    from batchpilot.train.accelerators import planned_gpu, require_planned_accelerator

    config = parse_config(spec["config"])
    cluster = config.cluster
    mine = RankResult(
        rank=int(os.environ.get("RANK", "0")), node=int(os.environ.get("GROUP_RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")), host=socket.gethostname(), devices=0,
    )  # fmt: skip
    backend = "nccl" if planned_gpu(accelerator_type=cluster.accelerator_type) else "gloo"
    try:
        require_planned_accelerator(
            accelerator_type=cluster.accelerator_type,
            runtime=resolved_runtime(config),
        )
        mine.devices = _visible_devices(backend, local_rank=mine.local_rank)
        _init_process_group(backend)
    except Exception as error:  # before the group: this rank alone can say it
        mine.error = _one_line(error)
        print(failure_line(mine), file=sys.stderr, flush=True)
        return 1
    try:
        return _checked_and_measured(mine, spec=spec, config=config, backend=backend)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _checked_and_measured(mine: RankResult, *, spec: dict[str, Any], config: Any, backend: str) -> int:
    import torch.distributed as dist

    world_size, local_world_size = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _node_checks(mine, config=config, result_uri=spec["result_uri"], world_size=world_size,
                 local_world_size=local_world_size, backend=backend)  # fmt: skip
    results = _gathered(mine, world_size=world_size)
    failed = [r for r in results if r.error]
    if failed:
        if mine.rank == 0:
            print(failure_line(failed[0]), file=sys.stderr, flush=True)
        return 1
    num_bytes = ALL_REDUCE_BYTES[backend]
    try:
        time_s = _timed_all_reduce(num_bytes, backend=backend, local_rank=mine.local_rank)
    except Exception as error:
        mine.error = f"the all-reduce of {num_bytes} bytes over {backend} failed: {_one_line(error)}"
        print(failure_line(mine), file=sys.stderr, flush=True)
        return 1
    if backend == "nccl":  # NCCL has logged its transport by now; every rank says which it got
        mine.nccl_network = nccl_network(_own_nccl_log())
        results = _gathered(mine, world_size=world_size)
    # Rank 0 judges and writes canary.json; every rank then exits with its verdict, so a failed canary fails
    # on every node at once (a node that exited 0 would wait at torchrun's exit barrier, up to 300 s, for a
    # node that failed).
    code = (
        _judged(mine, results, spec=spec, backend=backend, num_bytes=num_bytes, time_s=time_s)
        if mine.rank == 0
        else 0
    )
    verdict = [code]
    dist.broadcast_object_list(verdict, src=0)
    return int(verdict[0])


def _judged(
    mine: RankResult,
    results: list[RankResult],
    *,
    spec: dict[str, Any],
    backend: str,
    num_bytes: int,
    time_s: float,
) -> int:
    """Rank 0: the summary written to canary.json, and 1 with the failure line when it names a problem."""
    summary = summarize(results, spec=spec, backend=backend, all_reduce_bytes=num_bytes, time_s=time_s,
                        nccl_version=_nccl_version(backend))  # fmt: skip
    from batchpilot.storage import join_uri

    uri = join_uri(spec["result_uri"], CANARY_FILE)
    try:
        write_canary(
            spec["result_uri"], asdict(summary) | {"started_at": mine.started_at, "finished_at": time.time()}
        )
    except Exception as error:
        mine.error = f"cannot write {uri}: {_one_line(error)}"
        print(failure_line(mine), file=sys.stderr, flush=True)
        return 1
    print(f"canary: wrote {uri}", flush=True)
    if (problem := summary.problem()) is not None:
        mine.error = problem
        print(failure_line(mine), file=sys.stderr, flush=True)
        return 1
    return 0


def _own_nccl_log() -> str:
    """This process's NCCL debug file (NCCL_DEBUG_FILE with %h and %p expanded), or "" when there is none."""
    pattern = os.environ.get("NCCL_DEBUG_FILE", "")
    if not pattern:
        return ""
    path = Path(pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid())))
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _nccl_version(backend: str) -> str | None:
    if backend != "nccl":
        return None
    import torch

    return ".".join(str(n) for n in torch.cuda.nccl.version())


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0][:400]


def _visible_devices(backend: str, *, local_rank: int) -> int:
    import torch

    if backend != "nccl":
        return 0
    torch.cuda.set_device(local_rank)
    return int(torch.cuda.device_count())


def _init_process_group(backend: str) -> None:
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=CANARY_TIMEOUT_S))
    except Exception as error:
        raise BatchpilotError(
            "the process group",
            f"({backend}, {os.environ.get('WORLD_SIZE', '?')} ranks via {os.environ.get('MASTER_ADDR', '?')}:"
            f"{os.environ.get('MASTER_PORT', '?')}) did not form within {CANARY_TIMEOUT_S} s: {_one_line(error)}",
        ) from None


def _node_checks(
    mine: RankResult, *, config: Any, result_uri: str, world_size: int, local_world_size: int, backend: str
) -> None:
    """The storage checks of this rank's node: its loading rank reads the shards, its first rank writes and
    reads the probe. A failure is kept in `mine.error` (the ranks compare notes before the all-reduce)."""
    from batchpilot.data.sampling import loading_group

    try:
        group = loading_group(
            rank=mine.rank, world_size=world_size, local_world_size=local_world_size,
            expansion_factor=config.data.expansion_factor_real_data,
        )  # fmt: skip
        reads = group.reader_rank == mine.rank and (
            config.data.expansion_factor_real_data > 1 or mine.local_rank == 0
        )
        if reads:
            mine.read_bytes, mine.read_s = _read_shards(config.data.uri, node=mine.node, backend=backend)
        if mine.local_rank == 0:
            mine.checkpoint_write_ms, mine.checkpoint_read_ms = _probe_checkpoint_uri(
                result_uri, node=mine.node
            )
    except Exception as error:
        mine.error = _one_line(error)


def _read_shards(uri: str, *, node: int, backend: str) -> tuple[int, float]:
    """(bytes, seconds) of reading a range of the train split, opened (and checked) as the trainers open
    it; the time is the read's alone."""
    from batchpilot.data.shards import ShardSet

    shards = ShardSet.open(uri=uri, split="train")
    try:
        count = min(shards.num_tokens, READ_BYTES[backend] // shards.dtype.itemsize)
        start = node * count % max(shards.num_tokens - count, 1)  # each node its own range where it can
        started = time.perf_counter()
        (tokens,) = shards.read_tokens([(start, start + count)])
        elapsed = time.perf_counter() - started
    finally:
        shards.close()
    return int(tokens.nbytes), elapsed


def _probe_checkpoint_uri(result_uri: str, *, node: int) -> tuple[float, float]:
    """(write ms, read ms) of one object under the checkpoint URI, which is deleted again."""
    from batchpilot.storage import join_uri, open_storage

    name = f"probe-node{node}-{uuid.uuid4().hex[:8]}"
    uri = join_uri(result_uri, name)
    data = os.urandom(PROBE_BYTES)
    try:
        storage = open_storage(result_uri)
        started = time.perf_counter()
        storage.write(name, data)
        written = time.perf_counter()
        back = storage.read(name)
        read = time.perf_counter()
        storage.delete(name)
    except Exception as error:
        raise BatchpilotError(
            uri, f"a probe under train.checkpoint_uri failed (write, read back, delete): {_one_line(error)}"
        ) from None
    if back != data:
        raise BatchpilotError(uri, f"read back {len(back)} bytes that differ from the {len(data)} written")
    return (written - started) * 1000, (read - written) * 1000


def _gathered(mine: RankResult, *, world_size: int) -> list[RankResult]:
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, asdict(mine))
    return [RankResult(**item) for item in gathered]


def _timed_all_reduce(num_bytes: int, *, backend: str, local_rank: int) -> float:
    """Seconds per all-reduce of `num_bytes` (float32), the mean of TIMED_ITERATIONS after a warm-up."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(WARMUP_ITERATIONS):
        dist.all_reduce(buffer)
    synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(TIMED_ITERATIONS):
        dist.all_reduce(buffer)
    synchronize()
    elapsed = time.perf_counter() - started
    # The slowest rank's time is the collective's.
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item()) / TIMED_ITERATIONS
