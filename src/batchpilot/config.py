"""One typed, validated config tree loaded from YAML. Unknown keys are errors.

Every error names the key path and what would be valid; `load_config` turns pydantic's errors into
`ConfigError` lines such as `batch.rampup.increment: Input should be greater than 0 (got -16)`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from batchpilot.errors import BatchpilotError
from batchpilot.planning.tpu import is_tpu
from batchpilot.planning.units import parse_bytes, parse_count


def _count(value: Any) -> int:
    try:
        return parse_count(value, field="value")
    except BatchpilotError as error:
        raise ValueError(f"{error.problem}; {error.fix}" if error.fix else error.problem) from None


def _bytes(value: Any) -> int:
    try:
        return parse_bytes(value, field="value")
    except BatchpilotError as error:
        raise ValueError(f"{error.problem}; {error.fix}" if error.fix else error.problem) from None


Count = Annotated[int, BeforeValidator(_count), Field(ge=0)]
"""A sample/token count: an integer or a string with a K/M/B/T suffix (`10M`)."""
PositiveCount = Annotated[int, BeforeValidator(_count), Field(gt=0)]
ByteSize = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
"""A size in bytes: an integer or a string such as `2GiB`."""
PositiveInt = Annotated[int, Field(gt=0)]


class _Section(BaseModel):
    """Base of every section: frozen, and unknown keys are reported with the valid ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r}; valid keys are: {', '.join(cls.model_fields)}")
        return data


class ModelConfig(_Section):
    factory: str = Field(
        "batchpilot.models.gpt:build",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="import path `module:function` of a function returning a torch.nn.Module",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the factory")


class DataConfig(_Section):
    uri: str = Field(description="file://path or gs://bucket/prefix of a shard set with manifest.json")
    seq_len: PositiveInt = Field(
        description="tokens per sample fed to the model (each sample reads seq_len+1)"
    )
    expansion_factor_real_data: float = Field(
        1.0, gt=0, description="f > 1: only 1/f of the hosts read storage and forward to the others (MaxText)"
    )
    split: Literal["train", "validation"] = Field(
        "train", description="which split of the shard set to train on"
    )
    shuffle: bool = Field(True, description="a new seeded sample order every epoch (false: file order)")
    prefetch_steps: int = Field(2, ge=0, description="optimizer steps of data prepared ahead (bounds memory)")
    verify_checksums: bool = Field(
        True,
        description="check every shard's CRC32C against the manifest when opening (local files: reads them once)",
    )
    shuffle_block_samples: PositiveInt = Field(
        128,
        description="samples per contiguous block read at once (the shuffle permutes blocks, then windows)",
    )
    shuffle_window_blocks: PositiveInt = Field(
        8, description="blocks whose samples are shuffled together; memory ~ 2 windows of blocks"
    )

    @field_validator("expansion_factor_real_data")
    @classmethod
    def _whole_loading_factor(cls, value: float) -> float:
        # The trainer's loader makes every f-th host a loading host and refuses a fractional f > 1 at
        # start-up; refuse it here instead. f <= 1 (every host reads; f < 1 shrinks the batch to load) stays.
        if value > 1 and not float(value).is_integer():
            whole = " or ".join(str(f) for f in sorted({max(int(value), 2), int(value) + 1}))
            raise ValueError(
                f"{value} is not a whole number: with a factor above 1 each loading host reads for itself "
                f"and f - 1 whole other hosts, and the trainer refuses it at start-up; use {whole} (node "
                "counts are then multiples of it) or 1"
            )
        return value

    @model_validator(mode="after")
    def _known_scheme(self) -> DataConfig:
        if not self.uri.startswith(("file://", "gs://")):
            raise ValueError(f"uri {self.uri!r} must start with file:// or gs://")
        return self


class ClusterConfig(_Section):
    backend: Literal["local", "gke"] = Field("local", description="local processes, or a GKE node pool")
    devices_per_node: PositiveInt = Field(1, description="accelerators per node (local: processes per node)")
    max_nodes: PositiveInt = Field(description="node count of the target (final) stage at most")
    min_nodes: PositiveInt = Field(1, description="no stage runs on fewer nodes")
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
    launcher: Literal["jobset", "volcano"] = Field(
        "jobset",
        description="gke: JobSet (GKE standard, Kueue-friendly) or a Volcano Job (torchx kubernetes)",
    )
    kueue_queue: str | None = Field(
        None, description="gke: Kueue LocalQueue the JobSet is submitted to (none: no Kueue label)"
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
        "with a run whose Lease expired (and no running JobSet) is orphaned and scaled down by the next "
        "run's resize or `batchpilot pool scale-down --orphaned`",
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


class MegatronRampup(_Section):
    """NeMo/Megatron `[start, increment, ramp_samples]`."""

    start: PositiveInt
    increment: PositiveInt
    samples: PositiveCount = Field(description="samples over which the batch ramps from start to the target")


class MaxTextRampup(_Section):
    """MaxText per-device form: per-device start and increment; the target is global_batch_size."""

    per_device_start: float = Field(gt=0)
    per_device_increment: float = Field(gt=0)
    samples: PositiveCount = Field(description="MaxText global_rampup_samples")


class AdaptiveSettings(_Section):
    """The adaptive ramp-up's rule (batchpilot.planning.adaptive): stages end when the measured critical
    batch (the smoothed gradient noise scale) stays above the next batch size."""

    start: PositiveInt = Field(description="the first stage's global batch")
    samples: PositiveCount = Field(
        description="the ramp ends here at the latest: a stage that reaches it without the rule firing hands "
        "over to the target (global_batch_size)"
    )
    patience_samples: Count = Field(
        description="samples the smoothed estimate must stay at or above the next batch size before a stage "
        "ends"
    )
    smoothing: float = Field(
        0.9, gt=0, lt=1, description="decay per step of the moving averages of |G|^2 and S (as the trainer's)"
    )
    max_growth: float = Field(2.0, gt=1, description="the next batch is at most this times the current one")
    min_stage_samples: Count = Field(0, description="no stage ends before training this many samples")
    confidence: float = Field(
        2.0,
        ge=0,
        description="standard errors the estimate's lower bound keeps below it: a stage ends when the lower "
        "bound stays at or above the next batch size; 0 decides on the estimate alone",
    )
    doubling: bool = Field(
        False,
        description="candidate batch sizes are start x 2^k only (and the target): a batch-size warm-up that "
        "doubles the batch each time the measured critical batch passes the doubled size",
    )
    scale: float = Field(
        1.0,
        gt=0,
        description="multiplier on the measured B_simple (the critical batch measured by branched trials over "
        "B_simple at one checkpoint; docs/planning.md says how to calibrate it)",
    )
    max_stages: int = Field(
        6,
        ge=2,
        le=64,
        description="stages at most, the final one included: the compiled pipeline has this many launch slots, "
        "and the last ramp stage hands over to the target",
    )


class AdaptiveRampup(_Section):
    """`rampup: {adaptive: {...}}`: stages decided at run time by the measured critical batch."""

    adaptive: AdaptiveSettings


def _rampup_form(value: Any) -> str:
    if isinstance(value, AdaptiveRampup) or (isinstance(value, dict) and "adaptive" in value):
        return "adaptive"
    if isinstance(value, MaxTextRampup):
        return "maxtext"
    if isinstance(value, dict) and any(str(key).startswith("per_device") for key in value):
        return "maxtext"
    return "megatron"


def _rampup_list(value: Any) -> Any:
    if isinstance(value, list | tuple):
        if len(value) != 3:
            raise ValueError("the list form is [start, increment, samples]")
        return {"start": value[0], "increment": value[1], "samples": value[2]}
    return value


Rampup = Annotated[
    Annotated[MegatronRampup, Tag("megatron")]
    | Annotated[MaxTextRampup, Tag("maxtext")]
    | Annotated[AdaptiveRampup, Tag("adaptive")],
    Discriminator(_rampup_form),
    BeforeValidator(_rampup_list),
]


class BatchConfig(_Section):
    global_batch_size: PositiveInt | Literal["auto"] = Field(
        description="the target global batch size (samples per step), or `auto`: the target explore's "
        "gradient-noise study recommends, rounded to a size the ramp-up and the node schedule accept, with "
        "its LR rule (needs max_global_batch_size and explore.study)"
    )
    max_global_batch_size: PositiveInt | None = Field(
        None,
        description="with global_batch_size: auto, the largest target it may become: explore's largest micro "
        "batch, config check and the compiled pipeline's launch slots are sized for it",
    )
    micro_batch_size: PositiveInt | Literal["explore"] = Field(
        "explore", description="samples per device per pass, or `explore` to measure it"
    )
    auto_from: Literal["study", "trials"] = Field(
        "study",
        description="with global_batch_size: auto, where the target and its LR come from: explore's gradient-noise "
        "study, or the batch trials' measured critical batch (needs trials.enabled)",
    )
    rampup: Rampup | None = Field(
        None,
        description="NeMo/Megatron `[start, increment, samples]`, MaxText per-device, or `{adaptive: {...}}`: "
        "stages decided at run time by the measured critical batch",
    )
    schedule: str | None = Field(None, description='explicit ramp-up, e.g. "0:16 2K:32 4K:64" (`t` = tokens)')
    pipeline_parallel_size: PositiveInt = Field(1, description="pipeline stages per model replica")
    tensor_parallel_size: PositiveInt = Field(1, description="tensor-parallel devices per model replica")
    num_pipeline_microbatches: PositiveInt | None = Field(
        None, description="chunks of each pass's batch fed through the pipeline (multiple of the stages)"
    )

    @model_validator(mode="after")
    def _one_rampup_form(self) -> BatchConfig:
        if self.rampup is not None and self.schedule is not None:
            raise ValueError("set either rampup or schedule, not both")
        if self.global_batch_size == "auto" and self.schedule is not None:
            raise ValueError(
                "global_batch_size: auto takes its target from the study or the trials, but an explicit schedule "
                "fixes it (its last batch): set the target as an integer, or use the rampup form"
            )
        if (self.global_batch_size == "auto") != (self.max_global_batch_size is not None):
            raise ValueError(
                "max_global_batch_size bounds global_batch_size: auto: set both (auto and a bound) or neither"
            )
        if (
            self.num_pipeline_microbatches is not None
            and self.num_pipeline_microbatches % self.pipeline_parallel_size
        ):
            raise ValueError(
                f"num_pipeline_microbatches ({self.num_pipeline_microbatches}) must be a multiple of "
                f"pipeline_parallel_size ({self.pipeline_parallel_size})"
            )
        return self

    @property
    def target_bound(self) -> int:
        """The target global batch, or with `auto` the largest it may become (what must be planned for
        before explore's study decides)."""
        if self.global_batch_size == "auto":
            assert self.max_global_batch_size is not None
            return self.max_global_batch_size
        return self.global_batch_size


class TrainConfig(_Section):
    total_samples: PositiveCount | None = Field(None, description="samples to train on (or total_tokens)")
    total_tokens: PositiveCount | None = Field(None, description="tokens to train on (or total_samples)")
    lr: float = Field(gt=0, description="peak learning rate at lr_reference_batch")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="how a stage's LR follows its batch"
    )
    lr_reference_batch: PositiveInt | None = Field(
        None, description="batch at which lr applies (default: target)"
    )
    warmup_samples: Count = Field(0, description="linear LR warmup, in samples")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="decay shape after warmup"
    )
    lr_decay_samples: PositiveCount | None = Field(None, description="decay ends here (default: total)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="decay floor as a fraction of the peak")
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm; 0 disables clipping")
    checkpoint_uri: str = Field(description="file://path or gs://bucket/prefix for checkpoints")
    keep_checkpoints: PositiveInt = Field(2, description="how many recent checkpoints to keep")
    checkpoint_every_steps: int = Field(
        0, ge=0, description="also checkpoint every N optimizer steps (0: only at the end of each stage)"
    )
    checkpoint_every_s: float = Field(
        1800.0,
        ge=0,
        description="also checkpoint when this many seconds passed since the last checkpoint (rank 0's clock, "
        "checked between steps); a preemption without time to checkpoint loses at most this (0: off)",
    )
    seed: int = 0
    parallelism: Literal["auto", "ddp", "fsdp", "hsdp"] = Field(
        "auto",
        description="ddp: a full replica per device; fsdp: parameters, gradients and optimizer state sharded "
        "over all devices (FSDP2); hsdp: sharded within a node, replicated across nodes; auto: the first of "
        "ddp, hsdp, fsdp whose per-device memory estimate fits every stage",
    )
    runtime: Literal["auto", "eager", "xla"] = Field(
        "auto",
        description="eager: PyTorch on CUDA or CPU; xla: torch_xla (PJRT) with SPMD sharding over every device "
        "of the slice, one process per host (needs the `tpu` extra's torch/torch_xla pair); auto: xla when "
        "cluster.accelerator_type is a TPU type, else eager",
    )
    activation_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    compile: bool = Field(False, description="torch.compile the model")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU"
    )
    measure_noise_scale: bool = Field(
        True, description="estimate the gradient noise scale (every step where it is free; see below)"
    )
    measure_noise_every_steps: Count = Field(
        4,
        description="at gradient accumulation 1 (under fsdp, hsdp, xla or on one process), every Nth step "
        "runs its micro-batch as two halves to measure the noise scale: the same gradient, one more pass's "
        "collectives that step; 0: never (such stages do not measure). Steps with accumulation >= 2, and ddp "
        "on several ranks, measure every step at no cost",
    )
    measure_coherence: bool = Field(
        False, description="cosine between successive micro-batch gradients (costs a gradient copy)"
    )
    eval_samples: Count = Field(
        256,
        description="validation samples per evaluation, from the data's validation split (the same ones "
        "every time); 0: no validation loss",
    )
    eval_every_samples: Count = Field(
        0, description="also evaluate every N training samples (0: only at the end of each stage)"
    )
    init_from: str | None = Field(
        None,
        description="folder of a Hugging Face Llama checkpoint (config.json and safetensors weights), local or "
        "gs:// (downloaded once per node), whose weights the run's first start takes (optimizer fresh, step "
        "0); ignored once the run has its own checkpoint. Its config.json must match model.args (needs the "
        "`hf` extra)",
    )

    @model_validator(mode="after")
    def _one_total(self) -> TrainConfig:
        if (self.total_samples is None) == (self.total_tokens is None):
            raise ValueError("set exactly one of total_samples and total_tokens")
        if not self.checkpoint_uri.startswith(("file://", "gs://")):
            raise ValueError(f"checkpoint_uri {self.checkpoint_uri!r} must start with file:// or gs://")
        if (
            self.init_from is not None
            and "://" in self.init_from
            and not self.init_from.startswith(("file://", "gs://"))
        ):
            raise ValueError(
                f"init_from {self.init_from!r}: a checkpoint is read from a local folder, file:// or gs:// only; "
                "copy it to a gs:// folder or a local one"
            )
        return self

    @property
    def init_from_folder(self) -> Path | None:
        """`init_from` as a local folder (a `file://` prefix taken off), or None (unset, or gs://)."""
        if self.init_from is None or self.init_from.startswith("gs://"):
            return None
        return Path(self.init_from.removeprefix("file://"))


class ExploreConfig(_Section):
    memory_budget_bytes: ByteSize = Field(
        2 * 2**30, description="CPU only; on CUDA the device memory is the budget"
    )
    max_probes: PositiveInt = Field(12, description="measurements the search may spend")
    max_minutes: float = Field(
        5.0, gt=0, description="wall-clock budget of the search (a probe started in time may finish after it)"
    )
    activation_checkpointing: list[bool] = Field(
        default_factory=lambda: [False, True],
        min_length=1,
        description="settings to search; the first is searched from micro batch 1, the others from its frontier",
    )
    compile: list[bool] = Field(
        default_factory=lambda: [False], min_length=1, description="torch.compile settings to search"
    )
    warmup_steps: PositiveInt = Field(1, description="untimed passes at the start of each probe")
    timed_steps: PositiveInt = Field(3, description="timed passes of each probe, at least")
    min_timed_s: float = Field(
        0.3,
        ge=0,
        description="more timed passes until they add up to this many seconds (short passes are noisy)",
    )
    max_micro_batch_size: PositiveInt | None = Field(
        None,
        description="largest micro batch the search tries (default: batch.global_batch_size, "
        "since a micro batch never exceeds the global batch)",
    )
    probe_timeout_s: float = Field(
        120.0, gt=0, description="a probe still running after this is killed and recorded as not fitting"
    )
    accumulation_multipliers: list[PositiveInt] = Field(
        default_factory=lambda: [2, 4, 8, 16],
        description="effective-batch study at the recommended micro batch",
    )
    study_train_steps: int = Field(
        50,
        ge=0,
        description="optimizer steps before the study measures (an untrained model's noise says little)",
    )
    study_measure_batches: PositiveInt = Field(
        2, description="batches measured per accumulation multiplier in the study"
    )
    study_timeout_s: float = Field(300.0, gt=0, description="the study process is killed after this")
    study: bool = Field(
        True,
        description="run the effective-batch (gradient noise scale) study; with an integer "
        "batch.micro_batch_size and study false, the pipeline has no explore task",
    )


class TrialsConfig(_Section):
    """Batch trials: candidate global batches and LR multipliers raced on validation loss, each branch a short
    training from one warm-up checkpoint (`batchpilot trials`; docs/planning.md)."""

    enabled: bool = Field(False, description="run the trials (off by default)")
    tokens: PositiveCount | None = Field(
        None,
        description="tokens each branch trains after the warm-up, the same for every branch (rounded up to whole "
        "evaluation intervals); required when enabled",
    )
    warmup_samples: Count | None = Field(
        None,
        description="samples trained at the ramp's start batch before the branches (default: train.warmup_samples; "
        "rounded up to a multiple of every branch's batch)",
    )
    from_checkpoint: str | None = Field(
        None,
        description="branch from this checkpoint prefix (file:// or gs://, its `latest`) instead of a warm-up",
    )
    batch_sizes: list[PositiveInt] | None = Field(
        None,
        description="candidate global batches (default: 1x, 2x, 4x, 8x, 16x the ramp's start batch, up to the "
        "target, those the node schedule accepts)",
    )
    lr_multipliers: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [0.5, 1.0, 2.0],
        min_length=1,
        description="factors on the LR the run's scaling rule gives at each batch; one branch per batch and factor",
    )
    evaluations: PositiveInt = Field(
        4, description="validation losses per branch, at the same sample counts in every branch"
    )
    tolerance: float = Field(
        0.01,
        ge=0,
        description="a batch is within the critical batch while its loss at the budget is at most this fraction "
        "above the best smaller batch's",
    )
    parallelism: PositiveInt = Field(
        4, description="branches trained at once (KFP parallel-for; locally also bounded by the CPUs)"
    )
    calibrate_adaptive: bool = Field(
        False,
        description="with an adaptive ramp-up: set batch.rampup.adaptive.scale to the trials' critical batch over "
        "B_simple at the branch point (the warm-up's last noise-scale measurement) for the run",
    )
    budget_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="the largest share of all training samples (and node-hours) the trials may take; a plan "
        "over it is refused",
    )

    @model_validator(mode="after")
    def _tokens_when_enabled(self) -> TrialsConfig:
        if self.enabled and self.tokens is None:
            raise ValueError("trials.enabled needs trials.tokens (tokens each branch trains)")
        if self.from_checkpoint is not None and not self.from_checkpoint.startswith(("file://", "gs://")):
            raise ValueError(
                f"trials.from_checkpoint {self.from_checkpoint!r} must start with file:// or gs://"
            )
        return self


class Config(_Section):
    """The whole batchpilot config (see DESIGN.md for the vocabulary)."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$", description="run name (DNS label)")
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    data: DataConfig
    cluster: ClusterConfig
    batch: BatchConfig
    train: TrainConfig
    explore: ExploreConfig = Field(default_factory=ExploreConfig)  # type: ignore[arg-type]
    trials: TrialsConfig = Field(default_factory=TrialsConfig)  # type: ignore[arg-type]

    @model_validator(mode="before")
    @classmethod
    def _expansion_factor_in_batch(cls, data: Any) -> Any:
        """Accepts batch.expansion_factor_real_data as a spelling of data.expansion_factor_real_data."""
        if not isinstance(data, dict) or not isinstance(data.get("batch"), dict):
            return data
        if "expansion_factor_real_data" not in data["batch"]:
            return data
        batch = dict(data["batch"])
        factor = batch.pop("expansion_factor_real_data")
        section = dict(data.get("data") or {})
        if section.get("expansion_factor_real_data", factor) != factor:
            raise ValueError(
                "batch.expansion_factor_real_data and data.expansion_factor_real_data disagree; set it once"
            )
        section["expansion_factor_real_data"] = factor
        return {**data, "batch": batch, "data": section}

    @model_validator(mode="after")
    def _auto_needs_the_study(self) -> Config:
        if self.batch.auto_from == "trials":
            if self.batch.global_batch_size != "auto":
                raise ValueError("batch.auto_from applies to global_batch_size: auto; remove it or set auto")
            if not self.trials.enabled:
                raise ValueError(
                    "batch.auto_from: trials takes the target from the trials; set trials.enabled: true"
                )
            return self
        if self.batch.global_batch_size == "auto" and not self.explore.study:
            raise ValueError(
                "batch.global_batch_size: auto takes its target from explore's gradient-noise study; set "
                "explore.study: true (or an integer global_batch_size)"
            )
        return self

    @property
    def total_samples(self) -> int:
        """train.total_samples, or train.total_tokens in whole samples of data.seq_len tokens."""
        if self.train.total_samples is not None:
            return self.train.total_samples
        assert self.train.total_tokens is not None
        return self.train.total_tokens // self.data.seq_len


def resolved_runtime(config: Config) -> Literal["eager", "xla"]:
    """`train.runtime` resolved: `auto` is xla when `cluster.accelerator_type` is a GKE TPU type, else eager."""
    runtime = config.train.runtime
    if runtime != "auto":
        return runtime
    return "xla" if is_tpu(config.cluster.accelerator_type) else "eager"


def explore_fingerprint(config: Config) -> dict[str, Any]:
    """What explore's measurements depend on, keyed by config field: the model, the sequence length, the
    devices of a node, the parallelism and the weights the study starts from (`train.init_from`: a pretrained
    model's critical batch is far larger than a random one's). explore.json records it, and a plan refuses an
    explore.json whose fingerprint differs from its config's (`checks.explore_problems`; one written before a
    key was recorded reads as None there, the value of a config without train.init_from)."""
    return {
        "model.factory": config.model.factory,
        "model.args": config.model.model_dump(mode="json")["args"],
        "data.seq_len": config.data.seq_len,
        "cluster.devices_per_node": config.cluster.devices_per_node,
        "cluster.accelerator_type": config.cluster.accelerator_type,
        "train.parallelism": config.train.parallelism,
        "train.init_from": config.train.init_from,
    }


class ConfigError(BatchpilotError):
    """A config that does not validate; `lines` holds one message per problem."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("config", "; ".join(lines))

    def __str__(self) -> str:
        return "\n".join(self.lines)


_UNION_MEMBER = re.compile(r"^(constrained-int|int|literal\[.*\])$")
"""pydantic's tags for the members of `int | Literal[...]` fields (global_batch_size, micro_batch_size)."""


def _location(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for index, part in enumerate(loc):
        if isinstance(part, int):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{part}]"]
        elif (
            # the ramp-up union's tag, right after `rampup` (`adaptive` is also its member's only field)
            not (index and loc[index - 1] == "rampup" and part in ("megatron", "maxtext", "adaptive"))
            and not str(part).startswith("function-")
            and not _UNION_MEMBER.match(str(part))
        ):
            parts.append(str(part))
    return ".".join(parts) or "config"


def format_validation_error(error: ValidationError) -> list[str]:
    """One line per problem: `key.path: message (got value)`. A value that fits no member of an
    `int | Literal["word"]` field gets the integer's message with `(or 'word')` added, on one line."""
    lines: list[tuple[str, str, str]] = []  # (where, message, got)
    words: dict[str, str] = {}
    for item in error.errors(include_url=False):
        where = _location(tuple(item["loc"]))
        if item["type"] == "literal_error" and item["loc"] and _UNION_MEMBER.match(str(item["loc"][-1])):
            words[where] = str(item["ctx"]["expected"])  # the word the field also accepts
            continue
        message = str(item["msg"]).removeprefix("Value error, ")
        shown = item.get("input")
        got = f" (got {shown!r})" if item["type"] != "missing" and not isinstance(shown, dict) else ""
        lines.append((where, message, got))
    return [
        f"{where}: {message}{f' (or {words[where]})' if where in words else ''}{got}"
        for where, message, got in lines
    ]


def parse_config(data: Any) -> Config:
    """Validates a config mapping; raises ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError([f"config: the file must hold a mapping of sections, got {type(data).__name__}"])
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def load_config(path: str | Path) -> Config:
    """Reads and validates a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError([f"config: cannot read {path}: {error.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([f"config: {path} is not valid YAML{where}"]) from None
    return parse_config(data)


def config_schema() -> dict[str, Any]:
    """The JSON Schema of the config file."""
    return Config.model_json_schema()


def config_from_text(text: str, *, micro_batch_size: int = 0, total_samples: int = 0) -> Config:
    """The run's config from YAML (or JSON) text, with the pipeline's run-time overrides (0 = keep)."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise BatchpilotError("config_yaml", "is not a YAML mapping")
    if micro_batch_size:
        data.setdefault("batch", {})["micro_batch_size"] = micro_batch_size
    if total_samples:
        data.setdefault("train", {}).update(total_samples=total_samples, total_tokens=None)
    return parse_config(data)
