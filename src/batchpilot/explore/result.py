"""What an exploration found: its probes, the recommendation, the noise-scale study and where it wrote them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchpilot.explore.recommend import Recommendation
from batchpilot.explore.records import ProbeLayout, ProbeResult
from batchpilot.explore.study import NoiseScaleReport

SINGLE_PROCESS = ProbeLayout()


@dataclass
class ExploreResult:
    """What `run_exploration` found and where it wrote it."""

    probes: list[ProbeResult]
    recommendation: Recommendation
    noise_scale: NoiseScaleReport | None
    output_dir: Path
    elapsed_s: float
    stopped_because: str
    layout: ProbeLayout = SINGLE_PROCESS
