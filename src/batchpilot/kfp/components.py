"""Thin KFP components: each converts its parameters, calls one `batchpilot.workflow` function, and
hands the results to KFP (artifacts, metrics, the plan text).

No business logic lives here. All components run the one batchpilot image; the function bodies import
batchpilot inside, as KFP lightweight components must (their source is copied into the compiled YAML).
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

    from batchpilot import workflow
    from batchpilot.logs import configure_console

    configure_console()
    config = workflow.config_from_text(config_yaml, micro_batch_size=micro_batch_size)
    folder = Path(explore_dir.path)
    workflow.explore(config, output_dir=folder, keep_configured_micro_batch=True)
    Path(explore_report.path).write_bytes((folder / "explore.html").read_bytes())
    for name, value in json.loads((folder / "explore_metrics.json").read_text()).items():
        explore_metrics.log_metric(name, value)
    if run_dir:
        workflow.keep_copies(run_dir, {f"explore/{name}": folder / name for name in workflow.EXPLORE_FILES})


def plan(
    config_yaml: str,
    micro_batch_size: int,
    total_samples: int,
    expected_num_stages: int,
    run_dir: str,
    plan_file: Output[Artifact],
    plan_table: Output[Markdown],
    explore_dir: Input[Artifact] = None,
    expected_launches: str = "",
    num_launch_slots: int = 0,
    plan_metrics: Output[Metrics] = None,
) -> str:
    """Validates every stage of the ramp-up and schedules its nodes; returns the run document (plan.json).

    `expected_launches`: the compiled launch groups' names, comma-separated ("": slots for any launches);
    `num_launch_slots`: how many launch groups the pipeline has (0: not checked). The launch count and
    the cost estimate, when there is one, go to `plan_metrics` (the pipeline always passes one)."""
    from pathlib import Path

    from batchpilot import workflow
    from batchpilot.logs import configure_console
    from batchpilot.report import plan_markdown

    configure_console()
    document = workflow.plan(
        workflow.config_from_text(config_yaml, total_samples=total_samples),
        micro_batch_size=micro_batch_size or None,
        explore=workflow.read_explore(Path(explore_dir.path) / "explore.json") if explore_dir else None,
        expected_num_stages=expected_num_stages,
    )
    workflow.check_pipeline_launches(
        document, expected=[n for n in expected_launches.split(",") if n], num_slots=num_launch_slots or None
    )
    if plan_metrics is not None:
        for name, value in workflow.plan_metrics(document).items():
            plan_metrics.log_metric(name, value)
    text = document.to_json()
    Path(plan_file.path).write_text(text)
    Path(plan_table.path).write_text(plan_markdown(document.plan, document.cost, document.memory))
    if run_dir:
        workflow.keep_copies(run_dir, {"plan.json": Path(plan_file.path), "plan.md": Path(plan_table.path)})
    return text


def prepare_explore_pool(config_yaml: str) -> int:
    """Brings the node pool up to the canary's nodes, which explore then measures on (the pool may idle at
    zero nodes)."""
    from batchpilot import workflow
    from batchpilot.logs import configure_console

    configure_console()
    config = workflow.config_from_text(config_yaml)
    return workflow.prepare_canary_pool(config)


def canary(config_yaml: str, plan_json: str, run_dir: str, canary_metrics: Output[Metrics]):
    """Checks and measures the first launch's nodes before anything trains (devices, all-reduce, data,
    checkpoint URI); fails with the failing rank's one line. `plan_json` "": no plan yet (explore follows)."""
    from pathlib import Path

    from batchpilot import workflow
    from batchpilot.logs import configure_console
    from batchpilot.rundoc import parse_run_document

    configure_console()
    document = parse_run_document(plan_json) if plan_json else None
    work_dir = Path(run_dir) / "canary" if run_dir else None
    metrics = workflow.canary(workflow.config_from_text(config_yaml), document, work_dir=work_dir)
    for name, value in metrics.items():
        canary_metrics.log_metric(name, value)


def resize_pool(plan_json: str, launch_index: int) -> int:
    """Resizes the node pool to the node count of the plan's launch `launch_index` and waits for ready
    nodes; an unused launch slot leaves the pool alone (returns -1)."""
    from batchpilot import workflow
    from batchpilot.logs import configure_console
    from batchpilot.rundoc import parse_run_document

    configure_console()
    nodes = workflow.prepare_launch_pool(parse_run_document(plan_json), slot=launch_index)
    return -1 if nodes is None else nodes


def train_stage(plan_json: str, launch_index: int, run_dir: str, launch_metrics: Output[Metrics]):
    """Trains the stages of the plan's launch `launch_index` in one job to the last one's end sample,
    checkpointing at every stage end; logs the last step's metrics."""
    from pathlib import Path

    from batchpilot import workflow
    from batchpilot.logs import configure_console
    from batchpilot.rundoc import parse_run_document

    configure_console()
    document = parse_run_document(plan_json)
    metrics = workflow.train_stage(
        document, launch_index=launch_index, work_dir=Path(run_dir) if run_dir else None
    )
    for name, value in metrics.items():
        launch_metrics.log_metric(name, value)


def scale_down(config_yaml: str):
    """Scales the node pool back down (exit handler). It reads the config, not the plan, so it still runs
    when planning failed."""
    from batchpilot import workflow
    from batchpilot.logs import configure_console

    configure_console()
    workflow.scale_down(workflow.config_from_text(config_yaml))


def report(
    plan_json: str,
    run_dir: str,
    run_report: Output[HTML],
    plan_table: Output[Markdown],
    run_metrics: Output[Metrics],
    explore_dir: Input[Artifact] = None,
):
    """The run report: exploration, plan table, batch-size ramp and loss curve."""
    from pathlib import Path

    from batchpilot import workflow
    from batchpilot.logs import configure_console
    from batchpilot.rundoc import parse_run_document

    configure_console()
    document = parse_run_document(plan_json)
    summary, _ = workflow.report(
        document,
        explore_dir=Path(explore_dir.path) if explore_dir else None,
        html_path=Path(run_report.path),
        markdown_path=Path(plan_table.path),
    )
    for name, value in summary.items():
        run_metrics.log_metric(name, value)
    if run_dir:
        workflow.keep_copies(run_dir, {"report.html": Path(run_report.path)})
        workflow.keep_run_record(run_dir, document)


COMPONENT_FUNCTIONS = (
    prepare_explore_pool, canary, explore, plan, resize_pool, train_stage, scale_down, report,
)  # fmt: skip


def build_components(image: str) -> SimpleNamespace:
    """The components above, all on `image` (the batchpilot image, which already has kfp installed)."""
    return SimpleNamespace(
        **{
            f.__name__: dsl.component(f, base_image=image, install_kfp_package=False)
            for f in COMPONENT_FUNCTIONS
        }
    )
