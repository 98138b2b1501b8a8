"""The pipeline definition, re-exported from the package (`batchpilot.kfp.pipeline`)."""

from batchpilot.kfp.pipeline import DEFAULT_IMAGE, build_pipeline, stage_names

__all__ = ["DEFAULT_IMAGE", "build_pipeline", "stage_names"]
