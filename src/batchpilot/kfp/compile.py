"""Compiling the pipeline for a config: what `batchpilot compile` and `python pipelines/compile.py` run.

The output is deterministic (same config and image, same bytes); the compiled YAML of the example
configs is checked in under pipelines/compiled/ and a test fails when it drifts from the source.
"""

from __future__ import annotations

import logging
from pathlib import Path

from batchpilot.config import Config, load_config
from batchpilot.errors import BatchpilotError
from batchpilot.files import write_atomically
from batchpilot.kfp.shape import expected_stage_count, pipeline_launch_names
from batchpilot.workflow.plan import preflight

logger = logging.getLogger(__name__)

EXAMPLE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The example configs shipped inside the package (the repository's configs/ links here)."""
EXAMPLES = (
    "demo.yaml",
    "demo_adaptive.yaml",
    "nemo_gpt3_5b.yaml",
    "llama_5b.yaml",
    "llama_5b_tpu.yaml",
    "llama_70b.yaml",
    "maxtext_per_device.yaml",
)


TARGETS = ("kfp", "vertex")


def check_target(target: str) -> None:
    """Only open-source Kubeflow Pipelines runs this pipeline; Vertex AI Pipelines is refused, saying why."""
    if target == "vertex":
        raise BatchpilotError(
            "--target",
            "Vertex AI Pipelines is not supported: its tasks run outside the GKE cluster, so the resize and "
            "launch steps would need a Kubernetes client built from the cluster's Container API endpoint and "
            "a Google token, and its accelerator names differ from Kubernetes resource names",
            "run the pipeline on Kubeflow Pipelines installed in the cluster (--target kfp)",
        )
    if target not in TARGETS:
        raise BatchpilotError("--target", f"{target!r} is not a pipeline target", "use kfp")


def compile_pipeline(config: Config, *, image: str | None = None, target: str = "kfp") -> str:
    """The pipeline for `config` as KFP YAML text (`image`: default `cluster.image`, see `pipeline_image`)."""
    import tempfile

    from kfp import compiler

    from batchpilot.kfp.pipeline import build_pipeline

    check_target(target)
    preflight(config)  # a config that cannot run is refused before a pipeline exists
    pipeline = build_pipeline(config, image=image)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        return path.read_text()


def compile_file(
    config_path: str | Path, output: str | Path, *, image: str | None = None, target: str = "kfp"
) -> int:
    """Compiles the pipeline for the config file into `output`; returns its number of stages."""
    check_target(target)
    config = load_config(config_path)
    write_atomically(output, compile_pipeline(config, image=image, target=target))
    count = expected_stage_count(config)
    groups = len(pipeline_launch_names(config))
    logger.info("compiled %s -> %s (%d stage(s), %d launch group(s))", config_path, output, count, groups)
    return count
