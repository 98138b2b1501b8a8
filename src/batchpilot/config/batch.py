"""`batch:`: the target global batch, the micro batch and the ramp-up in its three forms (or adaptive)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from batchpilot.config.fields import Count, PositiveCount, PositiveInt, _Section


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


class SeesawSettings(_Section):
    """Seesaw (Meterez et al., arXiv 2510.14717): at each point where a step-decay schedule would divide the
    LR by `factor`, the batch grows by `factor` and the LR falls by its square root; the node schedule follows
    the batch like any ramp-up's."""

    start: PositiveInt = Field(description="the first stage's global batch (the LR applies unscaled there)")
    factor: int = Field(2, ge=2, description="the step decay's factor: the batch grows by it at each cut")
    cuts: list[PositiveCount] = Field(
        min_length=1,
        description="consumed samples where the step-decay schedule would cut the LR, in increasing order: the "
        "batch grows by the factor at each until it is the target global_batch_size (start x factor^k), and the "
        "cuts after that divide the LR by the factor",
    )


class SeesawRampup(_Section):
    """`rampup: {seesaw: {...}}`: the batch grows where a step decay would cut the LR (needs train.lr_decay:
    constant and train.lr_scaling: none; the trainer's LR is lr / sqrt(batch / start))."""

    seesaw: SeesawSettings


class AdaptiveRampup(_Section):
    """`rampup: {adaptive: {...}}`: stages decided at run time by the measured critical batch."""

    adaptive: AdaptiveSettings


def _rampup_form(value: Any) -> str:
    if isinstance(value, AdaptiveRampup) or (isinstance(value, dict) and "adaptive" in value):
        return "adaptive"
    if isinstance(value, SeesawRampup) or (isinstance(value, dict) and "seesaw" in value):
        return "seesaw"
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
    | Annotated[AdaptiveRampup, Tag("adaptive")]
    | Annotated[SeesawRampup, Tag("seesaw")],
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
        description="NeMo/Megatron `[start, increment, samples]`, MaxText per-device, `{adaptive: {...}}`: "
        "stages decided at run time by the measured critical batch, or `{seesaw: {start, factor, cuts}}`: the "
        "batch grows where a step decay would cut the LR, the LR falls by the factor's square root",
    )
    schedule: str | None = Field(None, description='explicit ramp-up, e.g. "0:16 2K:32 4K:64" (`t` = tokens)')
    pipeline_parallel_size: PositiveInt = Field(1, description="pipeline stages per model replica")
    num_pipeline_microbatches: PositiveInt | None = Field(
        None, description="chunks of each pass's batch fed through the pipeline (multiple of the stages)"
    )

    @model_validator(mode="before")
    @classmethod
    def _tensor_parallel_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tensor_parallel_size" in data:
            raise ValueError(
                "tensor_parallel_size is a train setting: move it to train.tensor_parallel_size "
                "(1, 2, 4 or 8 devices of one node per model replica)"
            )
        return data

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
