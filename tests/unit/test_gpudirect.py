"""GPUDirect networking of the trainer pods on A3 nodes (cluster/gpudirect.py, planning/gpudirect.py).

Each stack's JobSet, as `batchpilot launch --dryrun` renders it, is validated against the published JobSet
CRD and its Job with kubernetes-validate --strict; the figures expected are GKE's (see the module docstrings).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from test_cluster_launch import dryrun, gke_config, validate_k8s

from batchpilot.cluster.canary import canary_launch_spec, canary_spec
from batchpilot.cluster.gpudirect import GPUDirectPod
from batchpilot.cluster.launch import render_cluster_yaml
from batchpilot.config import parse_config
from batchpilot.plan.checks import plan_problems
from batchpilot.planning.gpudirect import MACHINE_STACKS, TCPX
from helpers import gke_a3_config, validate_crd

MEGA = {"machine_type": "a3-megagpu-8g", "accelerator_type": "nvidia-h100-mega-80gb"}
ULTRA = {"machine_type": "a3-ultragpu-8g", "accelerator_type": "nvidia-h200-141gb"}


def pod_template(jobset: dict) -> dict:
    validate_crd(jobset, "jobset.x-k8s.io_jobsets.yaml")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    validate_k8s({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job})
    return job["template"]


def trainer(pod: dict) -> tuple[dict, dict[str, str], dict[str, tuple[str, bool]]]:
    """(the trainer container, its env, its host mounts: mount path -> (host path, read-only))."""
    (container,) = pod["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    mounts = {
        m["mountPath"]: (host[m["name"]], m.get("readOnly", False))
        for m in container["volumeMounts"]
        if m["name"] in host
    }
    return container, env, mounts


def interfaces(pod: dict) -> list[tuple[str, str]]:
    annotations = pod["metadata"]["annotations"]
    assert annotations["networking.gke.io/default-interface"] == "eth0"
    return [
        (i["interfaceName"], i["network"]) for i in json.loads(annotations["networking.gke.io/interfaces"])
    ]


@pytest.fixture(scope="module")
def tcpx(tmp_path_factory) -> dict:
    return pod_template(dryrun(tmp_path_factory.mktemp("tcpx"), "final", machine_type="a3-highgpu-8g"))


def test_a3_high_pods_get_the_four_gpu_nics_the_tcpx_daemon_and_gkes_nccl_settings(tcpx):
    assert interfaces(tcpx) == [("eth0", "default"), ("eth1", "vpc1"), ("eth2", "vpc2"), ("eth3", "vpc3"), ("eth4", "vpc4")]  # fmt: skip
    (daemon,) = tcpx["spec"]["initContainers"]
    assert daemon["name"] == "tcpx-daemon" and daemon["restartPolicy"] == "Always"  # a native sidecar
    assert daemon["image"] == "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
    assert daemon["command"][daemon["command"].index("--uds_path") + 1] == "/run/tcpx"
    assert daemon["securityContext"]["capabilities"] == {"add": ["NET_ADMIN"]}
    devices = yaml.safe_load(tcpx["metadata"]["annotations"]["devices.gke.io/container.tcpx-daemon"])
    assert [d["path"] for d in devices][-3:] == ["/dev/nvidia7", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    container, env, mounts = trainer(tcpx)
    assert mounts == {
        "/usr/local/nvidia/lib64": ("/home/kubernetes/bin/nvidia/lib64", True),
        "/run/tcpx": ("/run/tcpx", False),  # the daemon's sockets, where the plugin is told to look
    }
    assert env["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"] == "/run/tcpx"
    assert env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
    assert env["NCCL_GPUDIRECTTCPX_CTRL_DEV"] == "eth0" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert (
        "LD_LIBRARY_PATH" not in env
    )  # the image's (test_the_image_puts_the_plugin_folder_on_the_library_path)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    shm = next(v for v in tcpx["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory"}
    # The trainer stays non-root, read-only, without capabilities; only the daemon runs as root.
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert (
        tcpx["spec"]["securityContext"]["runAsUser"] == 1000 and daemon["securityContext"]["runAsUser"] == 0
    )


def test_a3_mega_pods_get_eight_nics_the_tcpxo_daemon_and_source_the_installers_nccl_profile(tmp_path):
    pod = pod_template(dryrun(tmp_path, "final", **MEGA))
    assert interfaces(pod) == [("eth0", "default")] + [(f"eth{i}", f"vpc{i}") for i in range(1, 9)]
    (daemon,) = pod["spec"]["initContainers"]
    assert daemon["name"] == "tcpxo-daemon" and daemon["restartPolicy"] == "Always"
    assert daemon["image"] == "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21"
    devices = pod["metadata"]["annotations"]["devices.gke.io/container.tcpxo-daemon"]
    assert "- path: /dev/dmabuf_import_helper\n" in devices
    container, env, mounts = trainer(pod)
    assert mounts["/dev/aperture_devices"] == ("/dev/aperture_devices", False)
    assert env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"] == "/dev/aperture_devices"
    assert env["NCCL_LIB_DIR"] == "/usr/local/nvidia/lib64"
    command = container["command"][-1]
    assert "source /usr/local/nvidia/lib64/nccl-env-profile.sh && " in command
    assert command.index("nccl-env-profile.sh") < command.index("torchrun --rdzv_backend")


def test_a3_ultra_pods_get_the_rdma_networks_and_the_gib_plugin_without_a_daemon(tmp_path):
    pod = pod_template(dryrun(tmp_path, "final", **ULTRA))
    assert interfaces(pod) == [("eth0", "default")] + [(f"eth{i + 2}", f"rdma-{i}") for i in range(8)]
    assert "initContainers" not in pod["spec"]
    container, env, mounts = trainer(pod)
    assert mounts == {
        "/usr/local/nvidia": ("/home/kubernetes/bin/nvidia", True),
        "/usr/local/gib": ("/home/kubernetes/bin/gib", True),
    }
    assert "LD_LIBRARY_PATH" not in env
    assert "source /usr/local/gib/scripts/set_nccl_env.sh && " in container["command"][-1]


def test_networks_named_in_the_config_replace_the_guides_names(tmp_path):
    names = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    pod = pod_template(dryrun(tmp_path, "final", machine_type="a3-highgpu-8g", gpudirect_networks=names))
    assert interfaces(pod)[1:] == [(f"eth{i + 1}", name) for i, name in enumerate(names)]


@pytest.mark.parametrize(
    "cluster", [{"machine_type": "a3-highgpu-8g", "gpudirect": "off"}, {"machine_type": "a2-ultragpu-8g",
    "accelerator_type": "nvidia-a100-80gb", "cpu_per_node": 90}], ids=["off", "a2"],
)  # fmt: skip
def test_off_or_a_machine_without_gpu_nics_renders_the_plain_pod(tmp_path, cluster):
    pod = pod_template(dryrun(tmp_path, "final", **cluster))
    assert "initContainers" not in pod["spec"]
    annotations = pod["metadata"]["annotations"]
    assert not any(key.startswith(("networking.gke.io/", "devices.gke.io/")) for key in annotations)
    container, env, mounts = trainer(pod)
    assert mounts == {} and not any(name.startswith("NCCL_") for name in env)
    assert "source " not in container["command"][-1]


def test_the_volcano_job_carries_the_same_gpudirect_pod(tmp_path):
    volcano = dryrun(tmp_path, "0", launcher="volcano", machine_type="a3-highgpu-8g")
    validate_crd(volcano, "batch.volcano.sh_jobs.yaml")
    for task in volcano["spec"]["tasks"]:
        validate_k8s({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, **task["template"]})
        assert [c["name"] for c in task["template"]["spec"]["initContainers"]] == ["tcpx-daemon"]
        assert len(interfaces(task["template"])) == 5


def test_the_canary_job_measures_the_gpudirect_path_the_trainers_use():
    config = parse_config(gke_a3_config())
    spec = canary_spec(config, num_nodes=2)
    jobset = yaml.safe_load(render_cluster_yaml(canary_launch_spec(config, spec=spec, spec_path=None), cluster=config.cluster))  # fmt: skip
    pod = pod_template(jobset)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["tcpx-daemon"]
    assert interfaces(pod)[1:] == [(f"eth{i}", f"vpc{i}") for i in range(1, 5)]
    _, env, _ = trainer(pod)
    assert env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
    assert "canary-rank" in pod["spec"]["containers"][0]["command"][-1]


def test_the_image_puts_the_plugin_folder_on_the_library_path():
    # GKE's guides give the workload LD_LIBRARY_PATH=/usr/local/nvidia/lib64 (where the plugins are mounted);
    # the image's environment starts with it, so the pods leave it as the image sets it.
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    (line,) = [
        line.strip() for line in dockerfile.splitlines() if line.strip().startswith("LD_LIBRARY_PATH=")
    ]
    assert line.split("=", 1)[1].split(":")[0] == "/usr/local/nvidia/lib64"


def test_without_gpudirect_the_canary_expects_the_primary_nics_bandwidth():
    on = canary_spec(parse_config(gke_a3_config()), num_nodes=2)
    off = canary_spec(parse_config(gke_a3_config(gpudirect="off")), num_nodes=2)
    assert on["expected_bus_bandwidth_bytes_per_s"] == 800e9 / 8  # A3 High's four GPU NICs
    assert off["expected_bus_bandwidth_bytes_per_s"] == 200e9 / 8  # its primary NIC alone
    ultra = gke_a3_config(gpudirect="off")
    ultra["cluster"].update(machine_type="a3-ultragpu-8g", accelerator_type="nvidia-h200-141gb")
    assert canary_spec(parse_config(ultra), num_nodes=2)["expected_bus_bandwidth_bytes_per_s"] is None


# --- the settings script at the trainer's start ----------------------------------------------------


def run_setup(script: str) -> subprocess.CompletedProcess[str]:
    direct = GPUDirectPod(stack=TCPX, annotations={}, setup_script=script)
    line = direct.setup_command() + 'echo "started with $GIB_SETTING"'
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30)


def test_the_trainer_sources_the_plugins_settings_and_refuses_to_start_without_them(tmp_path: Path):
    script = tmp_path / "set_nccl_env.sh"
    script.write_text("export GIB_SETTING=from-the-plugin\n")
    done = run_setup(str(script))
    assert (done.returncode, done.stdout) == (0, "started with from-the-plugin\n")
    missing = run_setup(str(tmp_path / "absent.sh"))
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == (
        f"batchpilot: {tmp_path}/absent.sh is missing on this node: GPUDirect-TCPX needs the NCCL plugin installer "
        "DaemonSet of GKE on the node pool (docs/cluster.md, GPUDirect networking)\n"
    )


# --- config problems ----------------------------------------------------------------------------


def problems(**cluster: object) -> list[str]:
    return [str(p) for p in plan_problems(parse_config(gke_config(**cluster))) if "gpudirect" in p.field]


def test_gpudirect_settings_that_cannot_work_are_one_line_errors_at_plan_time():
    assert problems(machine_type="a3-highgpu-8g") == []
    assert problems(machine_type="a3-highgpu-8g", gpudirect_networks=["vpc1", "vpc2", "vpc3"]) == [
        "cluster.gpudirect_networks: a3-highgpu-8g has 4 GPU NICs (GPUDirect-TCPX) but 3 network names are "
        "given (fix: list the 4 GKE Network objects of the node pool's GPU NICs in NIC order (GKE's guide names "
        "them vpc1, vpc2, vpc3, vpc4), or remove the setting to use those names)"
    ]
    assert problems(
        machine_type="a3-highgpu-8g", gpudirect="off", gpudirect_networks=["a", "b", "c", "d"]
    ) == [
        "cluster.gpudirect_networks: is set but no GPUDirect networking is used: cluster.gpudirect is off "
        "(fix: remove it)"
    ]
    (a2,) = problems(
        machine_type="a2-ultragpu-8g", accelerator_type="nvidia-a100-80gb", gpudirect_networks=["a"]
    )
    assert a2.startswith("cluster.gpudirect_networks: is set but no GPUDirect networking is used: machine type a2-ultragpu-8g has no GPU NICs")  # fmt: skip
    assert problems(machine_type="a3-highgpu-8g", gpudirect_networks=["vpc1", "vpc1", "default", "Vpc4"]) == [
        "cluster.gpudirect_networks: 'default', 'Vpc4' cannot name a GPU NIC's GKE Network ('default' is the "
        "primary network; names are lower case letters, digits and '-') (fix: use the names of the Network "
        "objects made for the GPU NICs (`kubectl get networks`))",
        "cluster.gpudirect_networks: names a network twice (fix: give each GPU NIC its own GKE Network object)",
    ]


def test_every_gpu_nic_machine_type_has_its_stack():
    assert {machine: stack.name for machine, stack in MACHINE_STACKS.items()} == {
        "a3-highgpu-8g": "tcpx", "a3-megagpu-8g": "tcpxo", "a3-ultragpu-8g": "rdma", "a4-highgpu-8g": "rdma",
    }  # fmt: skip
    assert [stack.num_nics for stack in MACHINE_STACKS.values()] == [4, 8, 8, 8]
