"""The explore step: the fastest micro batch that fits one device, and the noise-scale study."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError

if TYPE_CHECKING:
    from batchpilot.explore import ExploreResult

logger = logging.getLogger(__name__)

EXPLORE_FILES = ("explore.json", "explore.html", "explore_metrics.json")


EXPLORE_NODES = 1
"""Nodes explore measures on (its probes run in the explore task's pod). The pool the explore task finds
holds the canary's nodes (`canary_nodes`), which the pipeline's canary ran on just before."""


def explore(
    config: Config,
    *,
    output_dir: Path,
    max_probes: int | None = None,
    max_minutes: float | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    study: bool | None = None,
    keep_configured_micro_batch: bool = False,
) -> ExploreResult:
    """Measures the fastest micro batch that fits one device (and the noise scale); writes EXPLORE_FILES.

    Args:
        study: run the noise-scale study (default: `explore.study`).
        keep_configured_micro_batch: with an integer `batch.micro_batch_size`, measure that size only
            (the pipeline explores then only for the study); without it, search as usual.
    """
    from batchpilot.explore import run_exploration

    configured = config.batch.micro_batch_size
    if keep_configured_micro_batch and micro_batch_sizes is None and configured != "explore":
        micro_batch_sizes = [configured]
    return run_exploration(
        config=config,
        output_dir=output_dir,
        max_probes=max_probes,
        max_minutes=max_minutes,
        micro_batch_sizes=micro_batch_sizes,
        study=config.explore.study if study is None else study,
    )


def read_explore(path: str | Path) -> dict[str, Any]:
    """A parsed explore.json, or a one-line error naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise BatchpilotError("--explore", f"cannot read {path}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("recommendation"), dict):
        raise BatchpilotError(
            "--explore", f"{path} holds no recommendation", "give explore.json of `batchpilot explore`"
        )
    return data
