"""`cluster:`: where the stages run (the local backend or a GKE node pool) and how the pods are placed."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from batchpilot.config.fields import ByteSize, PositiveInt, _Section

MAX_NODES = 65_000
"""The most nodes a stage may plan for: GKE's largest cluster ("Plan for large GKE clusters": up to 65,000
nodes). It also keeps every node walk of the planner bounded."""
OMITTED_WHEN_UNSET = ("priority_class", "training_runtime")
"""Settings added after the compiled pipelines' format settled: left out of a dump while unset, so that a
pipeline compiled from a config without them stays byte-identical (a config read back gets the default)."""
MAX_DEVICES_PER_NODE = 64
"""The most devices per node: the largest GPU machines have 16 (a2-megagpu-16g), TPU hosts 8; a local node
is that many processes on one machine."""


class ClusterConfig(_Section):
    omitted_when_unset = OMITTED_WHEN_UNSET
    backend: Literal["local", "gke"] = Field("local", description="local processes, or a GKE node pool")
    devices_per_node: PositiveInt = Field(
        1, le=MAX_DEVICES_PER_NODE, description="accelerators per node (local: processes per node)"
    )
    max_nodes: PositiveInt = Field(le=MAX_NODES, description="node count of the target (final) stage at most")
    min_nodes: PositiveInt = Field(1, le=MAX_NODES, description="no stage runs on fewer nodes")
    idle_nodes: int = Field(
        0,
        ge=0,
        description="pool size between runs: `batchpilot pool scale-down` and the exit handler go here",
    )
    pool_state_path: str | None = Field(
        None, description="local backend: JSON file recording the pool size (default runs/<name>/pool.json)"
    )
    project: str | None = Field(None, description="gke: GCP project id of the cluster")
    location: str | None = Field(None, description="gke: region or zone of the cluster, e.g. us-central1")
    cluster_name: str | None = Field(None, description="gke: name of the GKE cluster")
    node_pool: str | None = Field(None, description="gke: name of the node pool the trainers run on")
    pool_mode: Literal["resize", "autoscale", "static"] = Field(
        "resize",
        description="gke: resize = set the pool's size per stage (TPU: create the stage's slice pool, delete "
        "the previous one); autoscale = set the autoscaler's bounds (nodes come when the job's pods are "
        "pending; TPU: a pre-created pool per slice shape, scaled between 0 and one slice); static = never "
        "change the pool, only check capacity",
    )
    accelerator_type: str | None = Field(
        None, description="gke: GPU type label of the pool's nodes, e.g. nvidia-l4 (none: CPU nodes)"
    )
    tpu_zone: str | None = Field(
        None,
        description="gke, TPU: the zone of the slice node pools, e.g. us-east5-b (none: cluster.location when "
        "that is a zone); a multi-host slice lives in one zone",
    )
    tpu_slice_change: Literal["delete-first", "create-first"] = Field(
        "delete-first",
        description="gke, TPU, pool_mode resize: when a launch needs another slice shape, delete the previous "
        "slice pool before creating the next (delete-first: the TPU quota needs to cover one slice; the "
        "checkpoint is in the bucket) or only once the next slice is ready (create-first: quota for both)",
    )
    machine_type: str | None = Field(
        None,
        description="gke: machine type of the pool's nodes, e.g. a3-highgpu-8g; sizes the trainer pods "
        "(its GKE allocatable less a reserve for system DaemonSets). Known: the A2, A3 and G2 types in "
        "batchpilot.cluster.machines",
    )
    image: str | None = Field(
        None, description="gke: container image of the trainers, e.g. REGISTRY/batchpilot:0.1.0"
    )
    device_memory_bytes: ByteSize | None = Field(
        None,
        description="memory of one accelerator, e.g. 80GB (none: from accelerator_type's entry in the "
        "device table, batchpilot.planning.devices; local: explore.memory_budget_bytes); the plan checks "
        "every stage's per-device memory estimate against it",
    )
    device_peak_flops: float | None = Field(
        None,
        gt=0,
        description="dense bf16 peak FLOP/s of one accelerator, e.g. 989e12 (none: from the device table); "
        "gives MFU in metrics.jsonl and the report",
    )
    namespace: str = Field("batchpilot", description="gke: Kubernetes namespace of the jobs")
    service_account: str = Field(
        "batchpilot", description="gke: Kubernetes service account of the trainer pods (Workload Identity)"
    )
    launcher: Literal["jobset", "trainjob", "volcano"] = Field(
        "jobset",
        description="gke: JobSet (GKE standard, Kueue-friendly), a Kubeflow Trainer v2 TrainJob on "
        "training_runtime (Trainer builds the same JobSet; Kueue queues the TrainJob) or a Volcano Job "
        "(torchx kubernetes)",
    )
    training_runtime: str | None = Field(
        None,
        description="gke with launcher trainjob: the ClusterTrainingRuntime the TrainJobs run on (none: "
        "batchpilot, the one the chart installs with trainingRuntime.create); it must hold what `launch "
        "--dry-run` renders for the config (failure policy, sidecars, volumes), which is checked before each "
        "TrainJob is created",
    )
    kueue_queue: str | None = Field(
        None, description="gke: Kueue LocalQueue the JobSet is submitted to (none: no Kueue label)"
    )
    priority_class: str | None = Field(
        None,
        description="gke with kueue_queue: the Kueue WorkloadPriorityClass of the run's JobSets (label "
        "kueue.x-k8s.io/priority-class); a higher one may preempt lower ones in the queue's ClusterQueue, and a "
        "preempted launch resumes from its checkpoint once admitted again (none: Kueue's default priority)",
    )
    volcano_queue: str = Field("default", description="gke: Volcano queue when launcher is volcano")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="gke: extra node labels the trainer pods require (the node pool label is always added)",
    )
    tolerations: list[dict[str, str | int]] = Field(
        default_factory=list,
        description="gke: extra Kubernetes tolerations of the trainer pods (the GPU taint is always tolerated)",
    )
    cpu_per_node: PositiveInt | None = Field(
        None,
        description="gke: CPU cores of each trainer pod (none: from machine_type, else from the pool's "
        "ready nodes); at most the machine type's allocatable",
    )
    memory_per_node_bytes: ByteSize | None = Field(
        None,
        description="gke: memory of each trainer pod, e.g. 1700GiB (none: from machine_type, else from the "
        "pool's ready nodes); at most the machine type's allocatable",
    )
    env: dict[str, str] = Field(default_factory=dict, description="gke: extra environment of the trainers")
    gpudirect: Literal["auto", "off"] = Field(
        "auto",
        description="gke: GPUDirect networking of the trainer pods: auto = the machine type's stack (TCPX on "
        "a3-highgpu-8g, TCPXO on a3-megagpu-8g, RDMA on a3-ultragpu-8g and a4-highgpu-8g: the GPU NICs' "
        "networks, the receive-path daemon sidecar, the NCCL plugin's mounts and settings; the node pool needs "
        "the additional networks, docs/cluster.md); off = a plain pod on the primary network",
    )
    gpudirect_networks: list[str] | None = Field(
        None,
        description="gke, GPUDirect: the GKE Network objects of the node pool's GPU NICs in NIC order (none: "
        "the names GKE's guides create: vpc1..vpc4 on A3 High, vpc1..vpc8 on A3 Mega, rdma-0..rdma-7 on A3 "
        "Ultra and A4)",
    )
    ready_timeout_s: float = Field(
        1800.0, gt=0, description="gke: how long to wait for the pool's nodes to be Ready with their GPUs"
    )
    pending_timeout_s: float = Field(
        600.0,
        gt=0,
        description="gke: how long a trainer pod may stay Pending once the pool's nodes are ready (plus "
        "ready_timeout_s in autoscale mode) before the launch ends with the scheduler's or kubelet's reason "
        "(FailedScheduling, ImagePullBackOff) and its job is deleted",
    )
    operation_timeout_s: float = Field(
        1800.0, gt=0, description="gke: how long one node pool operation (resize, autoscaling) may take"
    )
    provisioning: Literal["resize", "flex-start"] = Field(
        "resize",
        description="gke, GPU: how a launch gets its nodes: resize = set the pool's size (pool_mode); "
        "flex-start = a ProvisioningRequest (class queued-provisioning.gke.io) for the launch's node count on "
        "a pool created with flex-start and queued provisioning: GKE grants every node at once or none, and "
        "the request is deleted when the launch ends (docs/cluster.md)",
    )
    capacity_timeout_s: float | None = Field(
        None,
        gt=0,
        description="how long a launch waits for its planned node count (resize: the pool's ready nodes; "
        "flex-start: the ProvisioningRequest provisioned) before it fails, or with fewer_nodes: allow trains "
        "on the nodes it got (none: ready_timeout_s)",
    )
    fewer_nodes: Literal["fail", "allow"] = Field(
        "fail",
        description="when a launch's pool reaches only some of its planned nodes by capacity_timeout_s "
        "(stockout, quota): fail with the shortfall, or allow = train on the largest node count at most "
        "the ready ones that the launch's global batches divide into (same batches, samples and LR; only "
        "data parallelism and accumulation change); the next launch asks for its planned count again",
    )
    local_capacity_nodes: PositiveInt | None = Field(
        None,
        description="local backend: the most nodes the local pool grants (none: max_nodes): a stand-in for a "
        "stockout, to try fewer_nodes on a laptop",
    )
    local_resize_delay_s: float = Field(
        0.0,
        ge=0,
        description="local backend: seconds a local pool takes to grow (its new nodes are ready that long after "
        "the resize), a stand-in for a cloud pool's resize to try capacity_ahead on a laptop (bench/stage_gap.py)",
    )
    capacity_ahead: Literal["auto", "off"] = Field(
        "auto",
        description="when the next launch needs more nodes: auto = ask for them while the current launch trains, "
        "timed from its measured step rate and the longest resize up measured in the run (else resize_lead_s) "
        "so that they are ready at its last step (a pool task beside the train task; resize pools, local and "
        "gke GPU/CPU); off = the next launch's own task resizes after the current launch ends",
    )
    resize_lead_s: float = Field(
        600.0,
        gt=0,
        description="capacity_ahead: how long a resize up is taken to last before one was measured in the run "
        "(the explore pool's, an earlier launch's)",
    )
    stage_timeout_s: float = Field(
        30 * 24 * 3600.0,
        gt=0,
        description="gke: how long one stage's train task (which follows the stage's JobSet) may run before "
        "KFP stops it; a retry resumes from the last checkpoint",
    )
    orphan_ttl_s: float = Field(
        1800.0,
        gt=0,
        description="gke: a run's tasks renew its Lease batchpilot-run-<name> for this long; a pool labelled "
        "with a run whose Lease expired is orphaned: the next run's resize takes it over, and "
        "`batchpilot pool scale-down --orphaned` deletes the run's JobSets and ProvisioningRequests and scales "
        "it down",
    )
    container_api_endpoint: str | None = Field(
        None,
        description="gke: URL of the GKE Container API (none: Google's public endpoint), for a private or "
        "regional endpoint, or a local emulator, e.g. http://127.0.0.1:PORT for the test simulator; http:// "
        "is an emulator (anonymous credentials), https:// uses Application Default Credentials",
    )

    @field_validator("container_api_endpoint")
    @classmethod
    def _endpoint_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+/?$", value):
            raise ValueError(
                f"{value!r} is not an http:// or https:// URL of a host, e.g. "
                "https://container.googleapis.com or http://127.0.0.1:8080 (an emulator)"
            )
        return value.rstrip("/") if value else value  # the client appends /v1/...

    @model_validator(mode="after")
    def _min_le_max(self) -> ClusterConfig:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must not exceed max_nodes ({self.max_nodes})")
        if self.idle_nodes > self.max_nodes:
            raise ValueError(f"idle_nodes ({self.idle_nodes}) must not exceed max_nodes ({self.max_nodes})")
        # The gke settings (project, image, ...) are required where the cluster is used, not here:
        # a gke config without them still plans (`batchpilot plan` needs no cluster).
        _check_tolerations(self.tolerations)
        return self


_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def _check_tolerations(tolerations: list[dict[str, str | int]]) -> None:
    """Kubernetes toleration fields only, so a typo fails here and not at pod creation."""
    for index, toleration in enumerate(tolerations):
        unknown = sorted(set(toleration) - _TOLERATION_KEYS)
        if unknown:
            raise ValueError(
                f"tolerations[{index}] has unknown key {unknown[0]!r}; valid keys are: "
                f"{', '.join(sorted(_TOLERATION_KEYS))}"
            )
        if toleration.get("operator", "Equal") not in ("Equal", "Exists"):
            raise ValueError(f"tolerations[{index}].operator must be Equal or Exists")
