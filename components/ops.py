"""The pipeline's KFP components, re-exported from the package (`batchpilot.kfp.components`).

The components live inside the batchpilot package so that an installed batchpilot can compile and run
the pipeline; this module keeps the top-level `components/` entry point for those who import it.
"""

from batchpilot.kfp.components import (
    COMPONENT_FUNCTIONS,
    build_components,
    explore,
    plan,
    report,
    resize_pool,
    scale_down,
    train_stage,
)

__all__ = [
    "COMPONENT_FUNCTIONS",
    "build_components",
    "explore",
    "plan",
    "report",
    "resize_pool",
    "scale_down",
    "train_stage",
]
