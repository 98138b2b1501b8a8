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

    from batchpilot.config import config_from_text
    from batchpilot.logs import configure_console
    from batchpilot.workflow.explore import EXPLORE_FILES, explore
    from batchpilot.workflow.report import keep_copies

    configure_console()
    config = config_from_text(config_yaml, micro_batch_size=micro_batch_size)
    folder = Path(explore_dir.path)
    explore(config, output_dir=folder, keep_configured_micro_batch=True)
    Path(explore_report.path).write_bytes((folder / "explore.html").read_bytes())
    for name, value in json.loads((folder / "explore_metrics.json").read_text()).items():
        explore_metrics.log_metric(name, value)
    if run_dir:
        keep_copies(run_dir, {f"explore/{name}": folder / name for name in EXPLORE_FILES})


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

    from batchpilot.config import config_from_text
    from batchpilot.kfp import shape
    from batchpilot.logs import configure_console
    from batchpilot.report import plan_markdown
    from batchpilot.workflow.explore import read_explore
    from batchpilot.workflow.plan import plan
    from batchpilot.workflow.report import keep_copies

    configure_console()
    document = plan(
        config_from_text(config_yaml, total_samples=total_samples),
        micro_batch_size=micro_batch_size or None,
        explore=read_explore(Path(explore_dir.path) / "explore.json") if explore_dir else None,
        expected_num_stages=expected_num_stages,
    )
    shape.check_pipeline_launches(
        document, expected=[n for n in expected_launches.split(",") if n], num_slots=num_launch_slots or None
    )
    if plan_metrics is not None:
        for name, value in shape.plan_metrics(document).items():
            plan_metrics.log_metric(name, value)
    text = document.to_json()
    Path(plan_file.path).write_text(text)
    Path(plan_table.path).write_text(plan_markdown(document.plan, document.cost, document.memory))
    if run_dir:
        keep_copies(run_dir, {"plan.json": Path(plan_file.path), "plan.md": Path(plan_table.path)})
    return text


def prepare_explore_pool(config_yaml: str) -> int:
    """Brings the node pool up to the canary's nodes, which explore then measures on (the pool may idle at
    zero nodes)."""
    from batchpilot.config import config_from_text
    from batchpilot.logs import configure_console
    from batchpilot.workflow.canary import prepare_canary_pool

    configure_console()
    config = config_from_text(config_yaml)
    return prepare_canary_pool(config)


def canary(config_yaml: str, plan_json: str, run_dir: str, canary_metrics: Output[Metrics]):
    """Checks and measures the first launch's nodes before anything trains (devices, all-reduce, data,
    checkpoint URI); fails with the failing rank's one line. `plan_json` "": no plan yet (explore follows)."""
    from pathlib import Path

    from batchpilot.config import config_from_text
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.canary import canary

    configure_console()
    document = parse_run_document(plan_json) if plan_json else None
    work_dir = Path(run_dir) / "canary" if run_dir else None
    metrics = canary(config_from_text(config_yaml), document, work_dir=work_dir)
    for name, value in metrics.items():
        canary_metrics.log_metric(name, value)


def resize_pool(plan_json: str, launch_index: int) -> int:
    """Resizes the node pool to the node count of the plan's launch `launch_index` and waits for ready
    nodes; an unused launch slot leaves the pool alone (returns -1)."""
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.capacity import prepare_launch_pool

    configure_console()
    nodes = prepare_launch_pool(parse_run_document(plan_json), slot=launch_index)
    return -1 if nodes is None else nodes


def bring_next_nodes(plan_json: str, launch_index: int) -> str:
    """Beside the train task of launch `launch_index`: grows the pool to the next launch's node count while
    this launch trains, timed to be ready at its last step (cluster.capacity_ahead); says what it did."""
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.ahead import bring_next_nodes

    configure_console()
    return bring_next_nodes(parse_run_document(plan_json), launch_index=launch_index)


def train_stage(plan_json: str, launch_index: int, run_dir: str, launch_metrics: Output[Metrics]):
    """Trains the stages of the plan's launch `launch_index` in one job to the last one's end sample,
    checkpointing at every stage end; logs the last step's metrics."""
    from pathlib import Path

    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.stage import train_stage

    configure_console()
    document = parse_run_document(plan_json)
    metrics = train_stage(document, launch_index=launch_index, work_dir=Path(run_dir) if run_dir else None)
    for name, value in metrics.items():
        launch_metrics.log_metric(name, value)


def prepare_trials_pool(plan_json: str) -> int:
    """Brings the node pool to what the trials hold at once (the warm-up, or `trials.parallelism` branches
    side by side) before the warm-up; returns that node count."""
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.trials import prepare_trials_pool

    configure_console()
    return prepare_trials_pool(parse_run_document(plan_json))


def trials_warmup(plan_json: str, run_dir: str) -> list[int]:
    """Trains the trials' warm-up from sample 0 at the ramp's start batch (nothing with
    `trials.from_checkpoint`); returns the branch indices the parallel-for runs. Locally its trainers' files
    go to `run_dir/trials/warmup`, each branch's to `run_dir/trials/<branch name>`."""
    from pathlib import Path

    from batchpilot.kfp import shape
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.trial_runs import run_warmup

    configure_console()
    document = parse_run_document(plan_json)
    run_warmup(document, work_dir=Path(run_dir) / "trials" if run_dir else None)
    return shape.trial_indices(document)


def trial_branch(plan_json: str, branch_index: int, run_dir: str, branch_metrics: Output[Metrics]) -> str:
    """Trains one branch of the trials from the warm-up checkpoint; returns its result (BranchResult as
    JSON, status "failed" with the reason when its training failed) and logs its figures as KFP metrics."""
    import dataclasses
    import json
    from pathlib import Path

    from batchpilot.kfp import shape
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.trial_runs import run_branch

    configure_console()
    document = parse_run_document(plan_json)
    work_dir = Path(run_dir) / "trials" if run_dir else None
    result = run_branch(document, index=branch_index, work_dir=work_dir)
    for name, value in shape.branch_metrics(document, result).items():
        branch_metrics.log_metric(name, value)
    return json.dumps(dataclasses.asdict(result))


def decide_trials(
    plan_json: str,
    results: list[str],
    run_dir: str,
    trials_metrics: Output[Metrics],
    plan_table: Output[Markdown],
    expected_launches: str = "",
    num_launch_slots: int = 0,
) -> str:
    """Decides the critical batch and LR from the branches' results (failed ones excluded) and returns the
    decided run document (plan.json), which every later task takes; keeps trials.json and plan.json in
    `run_dir`. `expected_launches` and `num_launch_slots` as for `plan`."""
    import json
    from pathlib import Path

    from batchpilot.kfp import shape
    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.planning.trials import BranchResult
    from batchpilot.report import plan_markdown
    from batchpilot.workflow.report import keep_copies
    from batchpilot.workflow.trial_runs import decide_trials
    from batchpilot.workflow.trials import keep_trials_record

    configure_console()
    branch_results = [BranchResult.from_dict(json.loads(text)) for text in results]
    document = decide_trials(parse_run_document(plan_json), branch_results)
    shape.check_pipeline_launches(
        document, expected=[n for n in expected_launches.split(",") if n], num_slots=num_launch_slots or None
    )
    for name, value in shape.trials_metrics(document).items():
        trials_metrics.log_metric(name, value)
    Path(plan_table.path).write_text(plan_markdown(document.plan, document.cost, document.memory))
    if run_dir:
        keep_trials_record(run_dir, document)
        keep_copies(run_dir, {"plan.md": Path(plan_table.path)})
    return document.to_json()


def scale_down(config_yaml: str):
    """Scales the node pool back down (exit handler). It reads the config, not the plan, so it still runs
    when planning failed."""
    from batchpilot.config import config_from_text
    from batchpilot.logs import configure_console
    from batchpilot.workflow.pool import scale_down

    configure_console()
    scale_down(config_from_text(config_yaml))


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

    from batchpilot.logs import configure_console
    from batchpilot.plan.rundoc import parse_run_document
    from batchpilot.workflow.report import keep_copies, keep_run_record, report

    configure_console()
    document = parse_run_document(plan_json)
    summary, _ = report(
        document,
        explore_dir=Path(explore_dir.path) if explore_dir else None,
        html_path=Path(run_report.path),
        markdown_path=Path(plan_table.path),
    )
    for name, value in summary.items():
        run_metrics.log_metric(name, value)
    if run_dir:
        keep_copies(run_dir, {"report.html": Path(run_report.path)})
        keep_run_record(run_dir, document)


COMPONENT_FUNCTIONS = (
    prepare_explore_pool, canary, explore, plan, resize_pool, bring_next_nodes, train_stage, prepare_trials_pool,
    trials_warmup,
    trial_branch, decide_trials, scale_down, report,
)  # fmt: skip


def build_components(image: str) -> SimpleNamespace:
    """The components above, all on `image` (the batchpilot image, which already has kfp installed)."""
    return SimpleNamespace(
        **{
            f.__name__: dsl.component(f, base_image=image, install_kfp_package=False)
            for f in COMPONENT_FUNCTIONS
        }
    )
