"""The plan step: the checked run document, and what `config check` and `compile` verify before any
accelerator is asked for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.checks import check_plan_config
from batchpilot.plan.planner import make_run_document
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.trials import TrialsOutcome, TrialsPlan
from batchpilot.workflow.trials import trials_pool_nodes

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def plan(
    config: Config,
    *,
    micro_batch_size: int | None = None,
    explore: dict[str, Any] | None = None,
    samples_per_s_per_device: float | None = None,
    expected_num_stages: int | None = None,
    announce: bool = True,
    trials: TrialsPlan | None = None,
    trials_outcome: TrialsOutcome | None = None,
) -> RunDocument:
    """The validated run document; with `expected_num_stages` (a compiled pipeline's), refuses another
    stage count before anything is resized (0 or None: any count; the launch slots are checked). `announce` logs its notes and the memory estimate."""
    from batchpilot.cluster.machines import machine_type_problem
    from batchpilot.train.shape import model_shape  # torch: only where a plan is made

    cluster = config.cluster
    unknown = machine_type_problem(
        machine_type_name=cluster.machine_type, accelerator_type=cluster.accelerator_type,
        cpu_per_node=cluster.cpu_per_node,
        memory_per_node_bytes=cluster.memory_per_node_bytes,
    )  # fmt: skip
    if cluster.backend == "gke" and unknown is not None:
        raise unknown
    document = make_run_document(
        config,
        micro_batch_size=micro_batch_size,
        explore=explore,
        samples_per_s_per_device=samples_per_s_per_device,
        shape=model_shape(factory=config.model.factory, args=config.model.args),
        trials=trials,
        trials_outcome=trials_outcome,
    )
    count = len(document.plan.stages)
    if expected_num_stages and count != expected_num_stages:
        raise BatchpilotError(
            "config_yaml",
            f"implies {count} stage(s) but this pipeline was compiled for {expected_num_stages}",
            "recompile it with `batchpilot compile --config <your config>` and upload the result",
        )
    if not announce:
        return document
    for note in document.notes:
        logger.info(note)
    if document.memory is not None:
        peak = document.memory.peak
        logger.info(
            "parallelism %s (train.parallelism: %s): at most %s per device (%s)",
            document.plan.parallelism, config.train.parallelism, peak.estimate.describe(), peak.stage,
        )  # fmt: skip
    return document


def preflight(config: Config) -> RunDocument | None:
    """What `config check` and `compile` verify before any accelerator is asked for.

    First everything that does not depend on the micro batch (`checks.check_plan_config`: ramp shape,
    schedule entries, stages no micro batch can place, the stage limit, the loading factor), every problem
    on its own line; then with an integer micro batch the whole plan (stages, node schedule, memory); with
    `explore`, the plan at micro batch 1, so a strategy that cannot even hold the model is refused now.
    With a known micro batch, also the node pool the trials' parallel branches need (`trials_pool_nodes`).
    An `auto` target is checked at its bound (`batch.max_global_batch_size`). Returns the document when
    the micro batch and the target are known."""
    check_plan_config(config)  # each micro-batch-independent problem on its own line, before the model
    auto = config.batch.global_batch_size == "auto"
    if auto:  # planned at its bound: the study sets the target later (planner.resolve_auto_target)
        bound = config.batch.target_bound
        batch = config.batch.model_copy(update={"global_batch_size": bound, "max_global_batch_size": None})
        config = config.model_copy(update={"batch": batch})
    if config.batch.micro_batch_size != "explore":
        document = plan(config, announce=False)
        if document.trials is not None:
            # Parallel branches the pool cannot hold fail now, not at their resize.
            trials_pool_nodes(document)
        return None if auto else document
    plan(config, micro_batch_size=1, announce=False)
    from batchpilot.plan.memory import explore_node_problem
    from batchpilot.train.shape import model_shape  # torch: only where a plan is made

    problem = explore_node_problem(config, model_shape(factory=config.model.factory, args=config.model.args))
    if problem is not None:
        raise problem
    return None


def check_data(config: Config) -> None:
    """What `config check` and `plan` verify of a local shard set (`checks.data_problems`): it exists, has a
    manifest, and its vocabulary fits the model. Not `compile`: a pipeline may be compiled before the data
    is prepared."""
    from batchpilot.plan.inputs import data_problems
    from batchpilot.planning.batch import raise_problems
    from batchpilot.train.shape import model_shape  # torch: only when a local manifest was read

    def model_vocab_size() -> int:
        return model_shape(factory=config.model.factory, args=config.model.args).vocab_size

    raise_problems(
        data_problems(
            data_uri=config.data.uri, model_vocab_size=model_vocab_size, seq_len=config.data.seq_len,
            split=config.data.split, largest_batch=config.batch.target_bound,
        )
    )  # fmt: skip
