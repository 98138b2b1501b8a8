"""The pipeline: explore -> plan -> one named sub-DAG per ramp-up stage (resize pool, train) -> report,
inside an exit handler that scales the pool down whatever happens.

Stages are unrolled from the config at compile time, so each is a visible task group in the KFP UI;
the plan step fails early, asking for a recompile, when a run's config implies another stage count.
"""

import json
from types import SimpleNamespace
from typing import Any

from kfp import dsl, kubernetes

from batchpilot import __version__
from batchpilot.config import Config
from batchpilot.kfp.components import build_components
from batchpilot.planning.stages import stage_name
from batchpilot.workflow import expected_stage_count

DEFAULT_IMAGE = f"batchpilot:{__version__}"

# Retries: a pool resize is idempotent; a stage resumes from its last checkpoint (e.g. after preemption).
RESIZE_RETRIES = 3
STAGE_RETRIES = 2


def stage_names(count: int) -> list[str]:
    """The task-group names of `count` stages (the plan's stage names)."""
    return [stage_name(k, num_stages=count) for k in range(count)]


def _on_accelerator(task: Any, config: Config) -> None:
    """Places a task that measures one device on the trainers' GPU pool (GKE); local runs need nothing."""
    if config.cluster.backend != "gke":
        return
    from batchpilot.cluster.placement import gpu_node_selector, gpu_tolerations

    if config.cluster.accelerator_type:
        task.set_accelerator_type(config.cluster.accelerator_type)
        task.set_accelerator_limit(1)
    for key, value in gpu_node_selector(config).items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for toleration in gpu_tolerations(config):
        kubernetes.add_toleration(task, **toleration)


def _stage_pipeline(ops: SimpleNamespace, *, index: int, name: str) -> Any:
    @dsl.pipeline(
        name=name, description=f"{name}: resize the node pool, then train the stage to its last sample"
    )
    def stage(plan_json: str, run_dir: str):
        resize = ops.resize_pool(plan_json=plan_json, stage_index=index)
        resize.set_display_name(f"{name}: resize pool")
        resize.set_caching_options(False)
        resize.set_retry(num_retries=RESIZE_RETRIES, backoff_duration="30s")
        train = ops.train_stage(plan_json=plan_json, stage_index=index, run_dir=run_dir).after(resize)
        train.set_display_name(f"{name}: train")
        train.set_caching_options(False)
        train.set_retry(num_retries=STAGE_RETRIES, backoff_duration="60s")

    return stage


def config_parameter(config: Config) -> str:
    """The config as one line of JSON (also valid YAML): KFP writes parameter defaults into a comment
    header of the compiled file, and a multi-line default would break that file."""
    return json.dumps(config.model_dump(mode="json"), separators=(",", ":"))


def build_pipeline(config: Config, *, image: str = DEFAULT_IMAGE) -> Any:
    """The pipeline for `config`, whose resolved form becomes the default of the `config_yaml` parameter."""
    config_yaml = config_parameter(config)
    ops = build_components(image)
    names = stage_names(expected_stage_count(config))
    stages = [_stage_pipeline(ops, index=k, name=name) for k, name in enumerate(names)]

    @dsl.pipeline(
        name=f"batchpilot-{config.name}",
        description=f"batchpilot {__version__}: explore the micro batch, plan a {len(names)}-stage ramp-up, "
        "train each stage on its node count, report; the pool is scaled down at the end.",
    )
    def batchpilot(
        config_yaml: str = config_yaml,
        micro_batch_size: int = 0,
        total_samples: int = 0,
        run_dir: str = "",
    ):
        """Run-time parameters.

        Args:
            config_yaml: the batchpilot config (YAML or JSON text). Changing the ramp-up or the total may change the
                stage count, which needs a recompiled pipeline (the plan step says so).
            micro_batch_size: 0 = the config's value, or the explored one when it says `explore`.
            total_samples: 0 = the config's train.total_samples / total_tokens.
            run_dir: a local folder that receives copies of the plan, report and metrics ("" = none).
        """
        scale = ops.scale_down(config_yaml=config_yaml)
        scale.set_display_name("scale pool down")
        scale.set_caching_options(False)
        scale.set_retry(num_retries=RESIZE_RETRIES, backoff_duration="30s")
        with dsl.ExitHandler(scale, name="explore-plan-train"):
            explore = ops.explore(config_yaml=config_yaml, micro_batch_size=micro_batch_size, run_dir=run_dir)
            explore.set_display_name("explore micro batch")
            explore.set_caching_options(False)  # a measurement of today's hardware, and it writes run_dir
            _on_accelerator(explore, config)
            plan = ops.plan(
                config_yaml=config_yaml,
                micro_batch_size=micro_batch_size,
                total_samples=total_samples,
                expected_num_stages=len(names),
                run_dir=run_dir,
                explore_dir=explore.outputs["explore_dir"],
            )
            plan.set_display_name("plan ramp-up")
            previous: Any = plan
            for name, stage in zip(names, stages, strict=True):
                task = stage(plan_json=plan.outputs["Output"], run_dir=run_dir).after(previous)
                task.set_display_name(name)
                task.set_caching_options(False)  # resizes a pool and trains: side effects
                previous = task
            report = ops.report(
                plan_json=plan.outputs["Output"], run_dir=run_dir, explore_dir=explore.outputs["explore_dir"]
            ).after(previous)
            report.set_display_name("report")
            report.set_caching_options(False)  # reads the metrics the stages just wrote

    return batchpilot
