"""Explore: find the fastest micro batch that fits one device, and the gradient noise scale.

`run_exploration(*, config, output_dir, ...)` runs probes (each a fresh process, see `probe`), a search
(`search`), the recommendation with its confidence (`recommend`), the effective-batch study (`study`)
and writes explore.json, explore.html and explore_metrics.json (`report`).
"""

from batchpilot.explore.recommend import Recommendation
from batchpilot.explore.records import ProbeRequest, ProbeResult, Setting
from batchpilot.explore.result import ExploreResult
from batchpilot.explore.runner import run_exploration

__all__ = ["ExploreResult", "ProbeRequest", "ProbeResult", "Recommendation", "Setting", "run_exploration"]
