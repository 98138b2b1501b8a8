"""One typed, validated config tree loaded from YAML. Unknown keys are errors.

The sections live in this package's modules (`fields`: types and the section base; `cluster`, `batch`,
`sections`: the rest); this module assembles them into `Config` and reads and checks a file.

Every error names the key path and what would be valid; `load_config` turns pydantic's errors into
`ConfigError` lines such as `batch.rampup.increment: Input should be greater than 0 (got -16)`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from batchpilot.config.batch import (
    AdaptiveRampup,
    AdaptiveSettings,
    BatchConfig,
    MaxTextRampup,
    MegatronRampup,
    SeesawRampup,
)
from batchpilot.config.cluster import ClusterConfig
from batchpilot.config.fields import _Section
from batchpilot.config.sections import DataConfig, ExploreConfig, ModelConfig, TrainConfig, TrialsConfig
from batchpilot.errors import BatchpilotError
from batchpilot.planning.tpu import is_tpu

__all__ = [
    "FINGERPRINT_DEFAULTS",
    "AdaptiveRampup",
    "AdaptiveSettings",
    "BatchConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ExploreConfig",
    "MaxTextRampup",
    "MegatronRampup",
    "ModelConfig",
    "SeesawRampup",
    "TrainConfig",
    "TrialsConfig",
    "config_from_text",
    "config_schema",
    "explore_fingerprint",
    "explores",
    "format_validation_error",
    "load_config",
    "parse_config",
    "resolved_runtime",
]


class Config(_Section):
    """The whole batchpilot config (docs/architecture.md has the vocabulary)."""

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


def explores(config: Config) -> bool:
    """Whether a run of `config` explores on the trainers' pool: a micro batch to find, or the noise-scale
    study (what the pipeline's explore task does)."""
    return config.batch.micro_batch_size == "explore" or config.explore.study


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
        "train.tensor_parallel_size": config.train.tensor_parallel_size,
        "train.init_from": config.train.init_from,
    }


FINGERPRINT_DEFAULTS: dict[str, Any] = {"train.tensor_parallel_size": 1}
"""Fingerprint keys added after explore.json files were written, at the value those were measured with."""


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
    `int | Literal["word"]` field gets the integer's message with `(or 'word')` added, on one line. A section
    given as something other than a mapping is told the keys it takes (the ramp-up: its forms) and the fix,
    not pydantic's name for the section's class."""
    sections: dict[str, type[_Section]] = {}
    pending: list[type[_Section]] = [_Section]
    while pending:  # every section class by name: pydantic's `model_type` error names only the class
        section = pending.pop()
        sections[section.__name__] = section
        pending += section.__subclasses__()
    lines: list[tuple[str, str, str, str]] = []  # (where, message, got, fix)
    words: dict[str, str] = {}
    for item in error.errors(include_url=False):
        where = _location(tuple(item["loc"]))
        if item["type"] == "literal_error" and item["loc"] and _UNION_MEMBER.match(str(item["loc"][-1])):
            words[where] = str(item["ctx"]["expected"])  # the word the field also accepts
            continue
        message, fix = str(item["msg"]).removeprefix("Value error, "), ""
        if where.endswith("rampup"):  # the ramp-up as a whole: a list, or one of three mappings
            fix = "e.g. rampup: [16, 16, 4096]; `batchpilot config schema` describes each form"
        if item["type"] == "model_type" and where.endswith("rampup"):  # a union: pydantic names one member
            message = (
                "must be a list [start, increment, samples] or a mapping of one of the forms {start, increment, "
                "samples}, {per_device_start, per_device_increment, samples} or {adaptive: {...}}"
            )
        elif item["type"] == "model_type" and str(item.get("ctx", {}).get("class_name")) in sections:
            keys = sections[str(item["ctx"]["class_name"])].model_fields
            message = f"must be a mapping of its keys ({', '.join(keys)})"
            fix = f"write {where.rsplit('.', 1)[-1]}: as a mapping, e.g. {{{next(iter(keys))}: ...}}"
        shown = item.get("input")
        got = f" (got {shown!r})" if item["type"] != "missing" and not isinstance(shown, dict) else ""
        lines.append((where, message, got, f" (fix: {fix})" if fix else ""))
    return [
        f"{where}: {message}{f' (or {words[where]})' if where in words else ''}{got}{fix}"
        for where, message, got, fix in lines
    ]


def parse_config(data: Any) -> Config:
    """Validates a config mapping; raises ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError([f"config: the file must hold a mapping of sections, got {type(data).__name__}"])
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently, so
    a second `train:` section would replace the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    [
                        f"config: the key {key!r} is given twice in one mapping (lines {seen[key]} and "
                        f"{key_node.start_mark.line + 1}), and YAML would keep only the second (fix: merge "
                        "them into one)"
                    ]
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path) -> Config:
    """Reads and validates a YAML config file (a key given twice in one mapping is refused)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError([f"config: cannot read {path}: {error.strerror}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([f"config: {path} is not valid YAML{where}"]) from None
    if data is None:
        raise ConfigError(
            [
                f"config: {path} is empty (fix: start from configs/demo.yaml, or `batchpilot config schema` for every key)"
            ]
        )
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
