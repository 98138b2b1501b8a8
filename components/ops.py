"""Thin KFP components: each converts its parameters and calls one function of `batchpilot.steps`.

No business logic lives here. All components run the one batchpilot image (its version is the
package version); the function bodies import batchpilot inside, as KFP lightweight components must.
"""

from types import SimpleNamespace

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Output


def explore(
    config_yaml: str,
    micro_batch_size: int,
    run_dir: str,
    explore_dir: Output[Artifact],
    explore_report: Output[HTML],
    explore_metrics: Output[Metrics],
):
    """Measures the fastest micro batch that fits one device and the gradient noise scale."""
    import json
    from pathlib import Path

    from batchpilot.steps import explore_step, keep_copies

    explore_step(config_yaml=config_yaml, micro_batch_size=micro_batch_size, output_dir=explore_dir.path)
    folder = Path(explore_dir.path)
    Path(explore_report.path).write_bytes((folder / "explore.html").read_bytes())
    for name, value in json.loads((folder / "explore_metrics.json").read_text()).items():
        explore_metrics.log_metric(name, value)
    if run_dir:
        keep_copies(run_dir, {f"explore/{p.name}": p for p in folder.iterdir() if p.is_file()})


def plan(
    config_yaml: str,
    micro_batch_size: int,
    total_samples: int,
    expected_num_stages: int,
    run_dir: str,
    explore_dir: Input[Artifact],
    plan_file: Output[Artifact],
    plan_table: Output[Markdown],
) -> str:
    """Validates every stage of the ramp-up and schedules its nodes; returns plan.json."""
    from pathlib import Path

    from batchpilot.planner import load_plan
    from batchpilot.report import plan_markdown
    from batchpilot.steps import keep_copies, plan_step

    text = plan_step(
        config_yaml=config_yaml,
        micro_batch_size=micro_batch_size,
        total_samples=total_samples,
        explore_json=str(Path(explore_dir.path) / "explore.json"),
        expected_num_stages=expected_num_stages,
    )
    Path(plan_file.path).write_text(text)
    Path(plan_table.path).write_text(plan_markdown(load_plan(text)[1]))
    if run_dir:
        keep_copies(run_dir, {"plan.json": Path(plan_file.path)})
    return text


def resize_pool(plan_json: str, stage_index: int) -> int:
    """Resizes the node pool to the stage's node count and waits for ready nodes."""
    from batchpilot.steps import resize_step

    return resize_step(plan_json=plan_json, stage_index=stage_index)


def train_stage(plan_json: str, stage_index: int, run_dir: str, stage_metrics: Output[Metrics]):
    """Trains the stage to its last sample on the pool, checkpoints and stops."""
    from batchpilot.steps import train_stage_step

    for name, value in train_stage_step(
        plan_json=plan_json, stage_index=stage_index, run_dir=run_dir
    ).items():
        stage_metrics.log_metric(name, value)


def scale_down(config_yaml: str):
    """Scales the node pool back down (exit handler)."""
    from batchpilot.steps import scale_down_step

    scale_down_step(config_yaml=config_yaml)


def report(
    plan_json: str,
    run_dir: str,
    explore_dir: Input[Artifact],
    run_report: Output[HTML],
    plan_table: Output[Markdown],
    run_metrics: Output[Metrics],
):
    """The run report: exploration, plan table, batch-size ramp and loss curve."""
    from pathlib import Path

    from batchpilot.steps import report_step

    summary = report_step(
        plan_json=plan_json,
        explore_json=str(Path(explore_dir.path) / "explore.json"),
        run_dir=run_dir,
        html_path=run_report.path,
        markdown_path=plan_table.path,
    )
    for name, value in summary.items():
        run_metrics.log_metric(name, value)


def build_components(image: str) -> SimpleNamespace:
    """The components above, all on `image` (the batchpilot image, which already has kfp installed)."""
    functions = (explore, plan, resize_pool, train_stage, scale_down, report)
    return SimpleNamespace(
        **{f.__name__: dsl.component(f, base_image=image, install_kfp_package=False) for f in functions}
    )
