"""Trainer pods are sized from the machine type's GKE allocatable, explicit sizes, or the nodes; never torchx's
defaults (2 CPUs, 1024 MB), which would OOMKill every stage.

Numbers: "Accelerator-optimized machine family" (a3-highgpu-8g: 208 vCPUs, 1,872 GB = GiB, 8 x H100 80GB) and
"About GKE node sizing" (kube-reserved CPU and memory bands, 100 MiB eviction threshold).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from batchpilot.cli import main
from batchpilot.cluster.machines import (
    DAEMONSET_RESERVE_BYTES,
    GIB,
    MACHINE_TYPES,
    MIB,
    Allocatable,
    MachineType,
    gke_allocatable,
    trainer_resources,
)
from batchpilot.cluster.readiness import (
    _node_state,
    parse_bytes_quantity,
    parse_cpu_millicores,
    smallest_allocatable,
)
from batchpilot.config import load_config, parse_config
from batchpilot.plan.planner import make_run_document
from helpers import REPO

NEMO = REPO / "configs" / "nemo_gpt3_5b.yaml"

# a3-highgpu-8g on GKE. CPU reserved: 6% of core 1 (60m) + 1% of core 2 (10m) + 0.5% of cores 3-4 (10m)
# + 0.25% of the other 204 cores (510m) = 590m. Memory reserved: 25% of 4 GiB + 20% of 4 + 10% of 8
# + 6% of 112 + 2% of the 1744 above 128 = 1 + 0.8 + 0.8 + 6.72 + 34.88 = 44.2 GiB, plus 100 MiB eviction.
A3_ALLOCATABLE_MILLICORES = 208_000 - 590
A3_ALLOCATABLE_BYTES = (
    1872 * GIB - -(-221 * GIB // 5) - 100 * MIB
)  # 44.2 GiB = 221/5 GiB, rounded up to bytes
# The cluster autoscaler's template node (cluster-autoscaler/cloudprovider/gce/reserved.go, COS, amd64) takes
# the kernel's share off first: 1872 GiB / 64 = 29.25 GiB, + 16 MiB, + 64 MiB (software IO TLB above 3 GiB),
# + min(0.175% of the memory, 248 MiB) = 248 MiB: 29.5703125 GiB.
A3_KERNEL_RESERVED_BYTES = 1872 * GIB // 64 + 16 * MIB + 64 * MIB + 248 * MIB
A3_TEMPLATE_BYTES = A3_ALLOCATABLE_BYTES - A3_KERNEL_RESERVED_BYTES  # 1798.1 GiB
# The trainer: the template less 1 CPU and 2 GiB for GKE's DaemonSets, in whole cores and torchx's "M" (10^6).
A3_TRAINER_CPU = (A3_ALLOCATABLE_MILLICORES - 1000) // 1000  # 206
A3_TRAINER_MB = (A3_TEMPLATE_BYTES - 2 * GIB) // 10**6  # 1928582


def dryrun(tmp_path: Path, config: dict, stage: str = "0") -> tuple[int, str, str]:
    """`batchpilot launch --dryrun` of `config` in this process: (exit code, stdout, stderr)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "plan.json").write_text(make_run_document(parse_config(config)).to_json())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["launch", "--plan", str(tmp_path / "plan.json"), "--stage", stage, "--dryrun"])
    return code, out.getvalue(), err.getvalue()


def nemo(**cluster: object) -> dict:
    config = load_config(NEMO).model_dump(mode="json")
    config["cluster"].update(cluster)
    return config


def container_resources(job_yaml: str) -> dict:
    job = yaml.safe_load(job_yaml)
    (container,) = job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    return container["resources"]


def test_the_nemo_example_requests_the_a3_node_less_the_daemonset_reserve(tmp_path):
    # Fails before machine types sized pods: cpu 0 and memMB 0 reached torchx, which wrote 2 CPUs and 1024M.
    code, out, err = dryrun(tmp_path, nemo())
    assert code == 0, err
    resources = container_resources(out)
    assert (A3_TRAINER_CPU, A3_TRAINER_MB) == (206, 1928582)
    assert resources["limits"] == {"cpu": "206000m", "memory": "1928582M", "nvidia.com/gpu": "8"}
    # Requests equal limits (torchx alone asks 100m CPU and 1024 MB less): the Guaranteed QoS class.
    assert resources["requests"] == resources["limits"]
    assert "2000m" not in out and "1024M" not in out


def test_gke_allocatable_follows_the_documented_reservations():
    assert gke_allocatable(MACHINE_TYPES["a3-highgpu-8g"]) == Allocatable(
        A3_ALLOCATABLE_MILLICORES, A3_ALLOCATABLE_BYTES
    )
    # Kubernetes reports 7910m allocatable on 8-vCPU GKE nodes: 60 + 10 + 10 + 4 x 2.5 = 90m reserved.
    assert gke_allocatable(MachineType(8, 32 * GIB, 0, "")).cpu_millicores == 7910
    # g2-standard-48 (4 x L4, 48 vCPUs, 192 GB): 190m reserved; 10.6 GiB + 100 MiB.
    g2 = gke_allocatable(MACHINE_TYPES["g2-standard-48"])
    assert g2.cpu_millicores == 47810
    assert 192 * GIB - g2.memory_bytes - 100 * MIB == pytest.approx(10.6 * GIB, abs=1)
    # A 150 GiB node keeps 140.1423 GiB (9.8577 GiB reserved with the eviction threshold).
    assert gke_allocatable(MachineType(32, 150 * GIB, 0, "")).memory_bytes / GIB == pytest.approx(
        140.1423, abs=1e-4
    )


def test_every_known_machine_type_leaves_a_trainer_room():
    for name, machine in MACHINE_TYPES.items():
        sized = trainer_resources(
            machine_type_name=name, cpu_per_node=None, memory_per_node_bytes=None, node_free=None
        )
        assert 1 <= sized.cpu < machine.vcpus, name
        assert GIB <= sized.memory_bytes < machine.memory_bytes - DAEMONSET_RESERVE_BYTES, name


def test_a_config_that_does_not_size_its_pods_fails_the_dry_run_in_one_line(tmp_path):
    code, out, err = dryrun(tmp_path, nemo(machine_type=None))
    assert code == 2 and out == ""
    assert err.strip() == (
        "batchpilot: error: cluster.machine_type: is needed to size the trainer pods; without it torchx "
        "gives each pod 2 CPUs and 1024 MB (fix: set cluster.machine_type to the node pool's machine type, "
        "e.g. a3-highgpu-8g, or set both cluster.cpu_per_node and cluster.memory_per_node_bytes)"
    )


def test_explicit_sizes_win_and_must_fit_the_machine(tmp_path):
    code, out, err = dryrun(tmp_path / "fits", nemo(cpu_per_node=100, memory_per_node_bytes="1000GiB"))
    assert code == 0, err
    assert container_resources(out)["limits"] == {
        "cpu": "100000m",
        "memory": "1073741M",
        "nvidia.com/gpu": "8",
    }

    code, _, err = dryrun(tmp_path / "cpu", nemo(cpu_per_node=208))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(
        "batchpilot: error: cluster.cpu_per_node: 208 CPUs do not fit a node of machine type"
    )
    assert err.strip().endswith("(fix: set at most 207)")

    code, _, err = dryrun(tmp_path / "memory", nemo(memory_per_node_bytes="1872GiB"))
    assert code == 2 and err.count("\n") == 1
    assert "cluster.memory_per_node_bytes:" in err and f"set at most {A3_TEMPLATE_BYTES}" in err


def test_explicit_sizes_alone_need_no_machine_type(tmp_path):
    code, out, err = dryrun(
        tmp_path, nemo(machine_type=None, cpu_per_node=200, memory_per_node_bytes="1000GB")
    )
    assert code == 0, err
    assert container_resources(out)["limits"]["memory"] == "1000000M"


def test_unknown_machine_types_and_mismatched_gpus_are_refused(tmp_path):
    code, _, err = dryrun(tmp_path / "unknown", nemo(machine_type="a3-highgpu-9g"))
    assert code == 2
    assert (
        "cluster.machine_type: 'a3-highgpu-9g' is not a machine type batchpilot knows (nearest: a3-highgpu-8g,"
        in err
    )
    assert "cluster.cpu_per_node and cluster.memory_per_node_bytes" in err
    # ... unless both sizes are given: then the table need not know the type.
    sized = nemo(machine_type="a4-highgpu-8g", cpu_per_node=200, memory_per_node_bytes="1000GB")
    assert dryrun(tmp_path / "unlisted", sized)[0] == 0

    code, _, err = dryrun(tmp_path / "gpu", nemo(machine_type="g2-standard-48"))
    assert code == 2
    assert (
        "cluster.accelerator_type: 'nvidia-h100-80gb' is not the GPU of g2-standard-48 nodes (nvidia-l4)"
        in err
    )

    code, _, err = dryrun(tmp_path / "count", nemo(machine_type="a3-highgpu-4g"))
    assert code == 2
    assert "cluster.devices_per_node: 8 exceeds the 4 GPU(s) of machine type a3-highgpu-4g" in err


def test_sizes_from_the_nodes_are_what_they_offer_whole_and_win_over_the_machine_table():
    free = Allocatable(cpu_millicores=7910, memory_bytes=28 * GIB)  # allocatable less DaemonSet requests
    sized = trainer_resources(
        machine_type_name="a3-highgpu-8g", cpu_per_node=None, memory_per_node_bytes=None, node_free=free
    )
    assert (sized.cpu, sized.memory_bytes) == (7, 28 * GIB)
    assert sized.source.startswith("the pool's ready nodes")
    with pytest.raises(ValueError, match=r"^cluster.cpu_per_node: 8 CPUs do not fit the pool's ready nodes"):
        trainer_resources(machine_type_name=None, cpu_per_node=8, memory_per_node_bytes=None, node_free=free)


def test_readiness_parses_allocatable_quantities():
    assert parse_cpu_millicores("7910m") == 7910
    assert parse_cpu_millicores("208") == 208_000
    assert parse_bytes_quantity("1869654592Ki") == 1869654592 * 1024
    assert parse_bytes_quantity("1.5Gi") == 3 * 2**29
    assert parse_bytes_quantity("64G") == 64 * 10**9


def node(name: str, *, cpu: str, memory: str) -> client.V1Node:
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1NodeSpec(),
        status=client.V1NodeStatus(
            conditions=[client.V1NodeCondition(type="Ready", status="True")],
            allocatable={"cpu": cpu, "memory": memory, "nvidia.com/gpu": "8"},
        ),
    )


def test_the_smallest_node_bounds_cpu_and_memory_separately():
    states = [
        _node_state(node("a", cpu="207410m", memory="1869654592Ki")),
        _node_state(node("b", cpu="207", memory="1.5Gi")),
    ]
    assert states[0].allocatable_cpu_millicores == 207410 and states[1].allocatable_memory_bytes == 3 * 2**29
    assert smallest_allocatable(states) == Allocatable(cpu_millicores=207_000, memory_bytes=3 * 2**29)
    assert smallest_allocatable([]) is None


def test_a_pods_requests_are_counted_as_the_scheduler_counts_them():
    from batchpilot.cluster.readiness import pod_requests, stays_on_node

    def container(cpu: str, memory: str, **extra: object) -> client.V1Container:
        return client.V1Container(
            name="c",
            resources=client.V1ResourceRequirements(requests={"cpu": cpu, "memory": memory}),
            **extra,
        )

    def pod(*, init=(), app=(), overhead=None, owner="DaemonSet", annotations=None) -> client.V1Pod:
        return client.V1Pod(
            metadata=client.V1ObjectMeta(
                owner_references=[client.V1OwnerReference(api_version="v1", kind=owner, name="o", uid="u")],
                annotations=annotations,
            ),
            spec=client.V1PodSpec(containers=list(app), init_containers=list(init), overhead=overhead),
        )

    # An installer that requests only in its init container: the pod needs the larger of the two.
    installer = pod(init=[container("150m", "300Mi")], app=[container("0", "0")])
    assert pod_requests(installer) == (150, 300 * MIB)
    # A sidecar (restartPolicy Always) runs beside the app containers: added; a later init container runs
    # with the sidecar, and only its peak counts if it is larger.
    sidecar = container("100m", "100Mi", restart_policy="Always")
    later = container("500m", "50Mi")
    mixed = pod(
        init=[sidecar, later], app=[container("200m", "200Mi")], overhead={"cpu": "10m", "memory": "1Mi"}
    )
    assert pod_requests(mixed) == (600 + 10, 300 * MIB + MIB)
    assert stays_on_node(installer)
    assert stays_on_node(pod(owner="Node"))  # a static pod's mirror
    assert stays_on_node(pod(owner="ReplicaSet", annotations={"kubernetes.io/config.mirror": "x"}))
    assert not stays_on_node(pod(owner="ReplicaSet"))
