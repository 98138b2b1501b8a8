"""`model:`, `data:`, `train:`, `explore:` and `trials:`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from batchpilot.config.fields import ByteSize, Count, PositiveCount, PositiveInt, _Section


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


class TrainConfig(_Section):
    omitted_when_unset = ("wsd_decay_fraction", "wsd_decay_shape")
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
    lr_decay: Literal["constant", "linear", "cosine", "wsd"] = Field(
        "cosine",
        description="decay shape after warmup; wsd = warmup-stable-decay: the peak LR held until the last "
        "wsd_decay_fraction of the span from the warmup's end to lr_decay_samples, then decayed to "
        "min_lr_ratio with wsd_decay_shape",
    )
    wsd_decay_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="lr_decay wsd: the share of the span from the warmup's end to lr_decay_samples spent "
        "decaying, at its end (none: 0.2)",
    )
    wsd_decay_shape: Literal["linear", "cosine", "1-sqrt"] | None = Field(
        None, description="lr_decay wsd: the decay's shape (none: 1-sqrt)"
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
    min_step_s: float = Field(
        0.0,
        ge=0,
        description="pace: every optimizer step lasts at least this long (the loop sleeps the rest), so a stage runs "
        "long enough to watch on any hardware, as `batchpilot rehearse` needs (0: off)",
    )
    seed: int = 0
    parallelism: Literal["auto", "ddp", "fsdp", "hsdp"] = Field(
        "auto",
        description="ddp: a full replica per device; fsdp: parameters, gradients and optimizer state sharded "
        "over all devices (FSDP2); hsdp: sharded within a node, replicated across nodes; auto: the first of "
        "ddp, hsdp, fsdp whose per-device memory estimate fits every stage",
    )
    hsdp_shard_nodes: int | None = Field(
        None,
        ge=1,
        le=65_000,
        description="hsdp: the nodes one shard group spans (parameters, gradients and optimizer state sharded over "
        "their devices, replicated across the groups); it must divide every stage's node count. Unset: the "
        "fewest such nodes whose memory estimate fits every stage (1 when one node is enough)",
    )
    tensor_parallel_size: Literal[1, 2, 4, 8] = Field(
        1,
        description="devices of one node that split each block's matrices (column- and row-parallel projections, "
        "sequence-parallel norms); the data-parallel size is the devices over it, and fsdp or hsdp shards over "
        "that. It must divide devices_per_node, the heads, the key/value heads, the MLP width and the vocabulary",
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
    def _wsd_settings(self) -> TrainConfig:
        for name in ("wsd_decay_fraction", "wsd_decay_shape"):
            if getattr(self, name) is not None and self.lr_decay != "wsd":
                raise ValueError(
                    f"{name} applies to lr_decay wsd only (lr_decay is {self.lr_decay}); remove it"
                )
        return self

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
