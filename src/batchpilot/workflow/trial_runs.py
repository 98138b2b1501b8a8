"""Running the batch trials (`planning/trials.py` is their arithmetic): a warm-up, the branches, the decision.

No trainer code of its own: the warm-up and each branch are runs of their own, derived from the run's config
and planned like any run, and launched by `workflow.run_stage` (torchx locally, a JobSet on GKE).

- The warm-up trains samples [0, warmup_samples) at the ramp's start batch, with the run's LR rule (its
  reference batch made explicit) held constant after the LR warm-up, into `<checkpoint_uri>/trials/warmup`.
- Branch k starts from a copy of the warm-up's latest checkpoint (or `trials.from_checkpoint`'s) in
  `<checkpoint_uri>/trials/<branch name>` and trains `branch_samples` more at its constant batch and LR, on
  its fewest nodes, as one stage that resumes at the warm-up's sample count. The trainer's data order is a
  function of the position (`consumed_samples`) and the seed, so every branch reads the same samples; a
  branch evaluates whenever its count crosses a multiple of gcd(start, eval_every_samples), which every
  branch steps onto exactly (both are multiples of every batch), and at its end.
- Its validation curve is read from the metrics kept beside its checkpoints (local and GKE alike).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchpilot import runstate
from batchpilot.config import AdaptiveRampup, Config, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.plan.rundoc import RunDocument
from batchpilot.planning.trials import (
    BranchResult,
    TrialBranch,
    TrialsOutcome,
    TrialsPlan,
    decide,
    derived_run_name,
)
from batchpilot.storage import join_uri
from batchpilot.workflow.trials import planned_trials

logger = logging.getLogger(__name__)

TRIALS_PREFIX = "trials"
"""Below the run's checkpoint_uri: the warm-up's and each branch's own checkpoints."""
ERROR_LINE = re.compile(r"batchpilot: error: |^(\w+\.)*\w*(Error|Exception|Interrupt)\b:? ")


def warmup_uri(config: Config) -> str:
    return join_uri(config.train.checkpoint_uri, f"{TRIALS_PREFIX}/warmup")


def branch_uri(config: Config, branch: TrialBranch) -> str:
    return join_uri(config.train.checkpoint_uri, f"{TRIALS_PREFIX}/{branch.name}")


def _derived(
    config: Config, *, name: str, batch: int, total_samples: int, lr: float, lr_scaling: str, **train: Any
) -> Config:
    """The run's config trained as one constant-batch stage `0:<batch>` to `total_samples`, LR constant
    after its warm-up, no trials of its own."""
    data = config.model_dump(mode="json")
    data["name"] = name
    data["batch"].update(
        global_batch_size=batch, max_global_batch_size=None, auto_from="study", rampup=None,
        schedule=f"0:{batch}",
    )  # fmt: skip
    data["train"].update(
        total_samples=total_samples, total_tokens=None, lr=lr, lr_scaling=lr_scaling, lr_decay="constant",
        lr_decay_samples=None, **train,
    )  # fmt: skip
    data["trials"] = {"enabled": False}
    return parse_config(data)


def warmup_config(document: RunDocument) -> Config:
    """The warm-up's config: samples [0, warmup_samples) at the start batch on the first stage's nodes,
    under the run's LR rule (reference batch explicit), warmed up within the warm-up, then constant."""
    from batchpilot.plan.stages import lr_schedule

    trials = planned_trials(document)
    config = document.config
    rule = lr_schedule(config)
    nodes = document.plan.stages[0].num_nodes
    derived = _derived(
        config, name=derived_run_name(config.name, "-trials"), batch=trials.start_batch,
        total_samples=trials.warmup_samples, lr=rule.lr, lr_scaling=rule.scaling,
        lr_reference_batch=rule.reference_batch, warmup_samples=min(rule.warmup_samples, trials.warmup_samples),
        checkpoint_uri=warmup_uri(config),
    )  # fmt: skip
    return _on_nodes(derived, nodes)


def branch_config(document: RunDocument, branch: TrialBranch, *, start_sample: int) -> Config:
    """Branch `branch`'s config: one stage at its batch to `start_sample + branch_samples`, resumed at
    `start_sample` from its copy of the start checkpoint, at the constant LR `branch.lr`, evaluating at
    every multiple of gcd(start_sample, eval_every_samples) and at its end, on `branch.num_nodes` nodes."""
    trials = planned_trials(document)
    config = document.config
    derived = _derived(
        config, name=derived_run_name(config.name, f"-trial-{branch.index}"), batch=branch.global_batch_size,
        total_samples=start_sample + trials.branch_samples, lr=branch.lr, lr_scaling="none",
        warmup_samples=min(config.train.warmup_samples, start_sample),
        eval_every_samples=math.gcd(start_sample, trials.eval_every_samples), checkpoint_uri=branch_uri(config, branch),
    )  # fmt: skip
    return _on_nodes(derived, branch.num_nodes)


def _on_nodes(config: Config, nodes: int) -> Config:
    cluster = config.cluster.model_copy(
        update={"max_nodes": nodes, "min_nodes": min(config.cluster.min_nodes, nodes)}
    )
    return config.model_copy(update={"cluster": cluster})


def _planned(config: Config, document: RunDocument) -> RunDocument:
    from batchpilot.workflow.plan import plan

    return plan(config, micro_batch_size=document.plan.micro_batch_size, announce=False)


def copy_checkpoint(source_uri: str, target_uri: str) -> int:
    """Copies the checkpoint `latest` names under `source_uri` to an emptied `target_uri` (its step folder's
    objects, then `latest`, last, as a save commits); returns its consumed_samples."""
    consumed = runstate.copy_latest_checkpoint(source_uri, target_uri)
    if consumed is None:
        raise BatchpilotError(
            "trials", f"{source_uri} holds no checkpoint to branch from", "run the warm-up first"
        )
    return consumed


def _launch(document: RunDocument, *, work_dir: Path | None, owner: str) -> int:
    """Trains the (one-stage) derived run; returns run_stage's exit code.

    On GKE the derived run renews its own Lease while it trains, under its own name; the pool is labelled
    with the run that owns it (`owner`), whose Lease must stay alive too, or a trial longer than
    cluster.orphan_ttl_s would leave the pool looking orphaned to the next run."""
    from batchpilot.workflow.stage import run_stage

    log_dir = None
    if work_dir is not None:
        log_dir = work_dir / "torchx"
        shutil.rmtree(log_dir, ignore_errors=True)  # a previous attempt's logs would give its error
    cluster = document.config.cluster
    owner_lease: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if cluster.backend == "gke":
        from batchpilot.cluster.ownership import lease_renewed
        from batchpilot.cluster.readiness import kube_api_client

        owner_lease = lease_renewed(
            kube_api_client, namespace=cluster.namespace, run=owner, ttl_s=cluster.orphan_ttl_s
        )
    with owner_lease:
        return run_stage(document, stage=0, work_dir=work_dir, log_dir=log_dir)


def run_warmup(document: RunDocument, *, work_dir: Path | None) -> None:
    """Trains the trials' warm-up (skipped when from_checkpoint, or when its checkpoint is already complete:
    a re-run resumes).

    Raises:
        BatchpilotError: the document has no trials, or the warm-up failed (nothing can branch from it).
    """
    trials = planned_trials(document)
    if trials.from_checkpoint:
        logger.info("trials: no warm-up, the branches start from %s", trials.from_checkpoint)
        return
    config = warmup_config(document)
    found = runstate.latest_checkpoint(config.train.checkpoint_uri)
    if found is not None and found[1] == trials.warmup_samples:
        logger.info("trials: the warm-up is complete (%s)", config.train.checkpoint_uri)
        return
    folder = work_dir / "warmup" if work_dir is not None else None
    logger.info(
        "trials: warm-up of %d samples at batch %d -> %s",
        trials.warmup_samples, trials.start_batch, config.train.checkpoint_uri,
    )  # fmt: skip
    code = _launch(_planned(config, document), work_dir=folder, owner=document.config.name)
    if code != 0:
        why = failure_reason(folder) if folder is not None else f"exit {code}"
        raise BatchpilotError(
            "trials", f"the warm-up failed: {why}", "fix the cause and run the trials again (it resumes)"
        )


def run_branch(document: RunDocument, *, index: int, work_dir: Path | None) -> BranchResult:
    """Trains branch `index` from the warm-up checkpoint (or from_checkpoint) and returns its validation
    curve; a branch that fails (e.g. CUDA out of memory, a crashed rank) returns status "failed" with its
    error's last line, never raises for a training failure (it does raise BatchpilotError for a bad document).
    """
    trials = planned_trials(document)
    if not 0 <= index < len(trials.branches):
        raise BatchpilotError(
            "--branch", f"{index} is not a branch of these trials (0..{len(trials.branches) - 1})"
        )
    if document.config.train.eval_samples == 0:
        raise BatchpilotError(
            "train.eval_samples", "is 0: the branches would have no validation loss to compare",
            "set train.eval_samples (and prepare the data with a validation split)",
        )  # fmt: skip
    branch = trials.branches[index]
    source = trials.from_checkpoint or warmup_uri(document.config)
    found = runstate.latest_checkpoint(source)
    if found is None:
        raise BatchpilotError(
            "trials", f"{source} holds no checkpoint to branch from", "run the warm-up first"
        )
    start = found[1]
    if trials.from_checkpoint is None and start != trials.warmup_samples:
        raise BatchpilotError(
            "trials", f"the warm-up at {source} is at sample {start}, not {trials.warmup_samples}",
            "run the warm-up to its end first",
        )  # fmt: skip
    unit = math.lcm(*trials.batch_sizes)
    if start % unit:
        raise BatchpilotError(
            "trials.from_checkpoint",
            f"its checkpoint is at sample {start}, not a multiple of every branch's batch ({unit})",
            "branch from a checkpoint at a multiple of every batch in trials.batch_sizes",
        )
    branch_document = _planned(branch_config(document, branch, start_sample=start), document)
    folder = work_dir / branch.name if work_dir is not None else None
    copy_checkpoint(source, branch_uri(document.config, branch))
    failed = BranchResult(branch.index, branch.global_batch_size, branch.lr_multiplier, "failed")
    try:
        code = _launch(branch_document, work_dir=folder, owner=document.config.name)
    except BatchpilotError as error:  # e.g. its pods could not be placed: this branch failed, not the trials
        return replace(failed, reason=str(error).splitlines()[-1])
    if code != 0:
        why = failure_reason(folder) if folder is not None else ""
        return replace(failed, reason=why or f"its launch exited {code}")
    return read_branch_result(trials, branch, start_sample=start, uri=branch_uri(document.config, branch))


def read_branch_result(
    trials: TrialsPlan, branch: TrialBranch, *, start_sample: int, uri: str
) -> BranchResult:
    """The branch's validation curve from the metrics kept beside its checkpoints at `uri`: (samples after the
    start, val_loss) at the plan's evaluation points; failed when any of them is missing."""
    from batchpilot.runstate import load_metrics

    losses = {
        int(record["consumed_samples"]) - start_sample: float(record["val_loss"])
        for record in load_metrics(uri)
        if record.get("val_loss") is not None and record["consumed_samples"] > start_sample
    }
    missing = [point for point in trials.eval_points if point not in losses]
    result = BranchResult(branch.index, branch.global_batch_size, branch.lr_multiplier, "ok")
    if missing:
        return replace(
            result,
            status="failed",
            reason=f"no validation loss at {', '.join(map(str, missing))} samples after the start in {uri}",
        )
    return replace(result, curve=tuple((point, losses[point]) for point in trials.eval_points))


def failure_reason(folder: Path) -> str:
    """The last error line a failed launch's trainers wrote (torchx logs under `folder/torchx`): a
    batchpilot error, else the last exception line of a traceback; empty when none is found."""
    found = ""
    for path in sorted((folder / "torchx").rglob("*")):
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            text = line.split("]:", 1)[-1].strip() if line.startswith("[") else line.strip()
            if "batchpilot: error: " in text:
                return text.split("batchpilot: error: ", 1)[1]
            if ERROR_LINE.search(text):
                found = text
    return found


def warmup_noise_scale(document: RunDocument) -> float | None:
    """The warm-up's last measured B_simple (the metrics kept beside its checkpoints), or None."""
    from batchpilot.runstate import load_metrics

    measured = [
        float(record["noise_scale"])
        for record in load_metrics(warmup_uri(document.config))
        if record.get("noise_scale") is not None
    ]
    return measured[-1] if measured else None


def decide_trials(document: RunDocument, results: Sequence[BranchResult]) -> RunDocument:
    """The decision (`planning.trials.decide` with the plan's tolerance) and the run's plan made again with
    the outcome (the configured `auto` target when the trials decide it), recorded in the returned document."""
    from batchpilot.workflow.plan import plan

    trials = planned_trials(document)
    outcome = TrialsOutcome(
        results=tuple(results),
        decision=decide(results, tolerance=trials.tolerance),
        noise_scale_at_start=None if trials.from_checkpoint else warmup_noise_scale(document),
    )
    config = document.config
    calibration = outcome.scale_calibration
    rampup = config.batch.rampup
    if config.trials.calibrate_adaptive and isinstance(rampup, AdaptiveRampup):
        if calibration is None:
            raise BatchpilotError(
                "trials.calibrate_adaptive",
                "needs the trials' critical batch and B_simple at the branch point, but "
                + ("the trials decided no critical batch" if outcome.decision.critical_batch is None else
                   "the warm-up measured no noise scale (train.measure_noise_scale, or branches from_checkpoint)"),
                "set batch.rampup.adaptive.scale yourself, or turn calibrate_adaptive off",
            )  # fmt: skip
        adaptive = rampup.adaptive.model_copy(update={"scale": calibration})
        batch = config.batch.model_copy(update={"rampup": rampup.model_copy(update={"adaptive": adaptive})})
        config = config.model_copy(update={"batch": batch})
    if trials.auto_bound is not None:  # planned at the bound (planner.at_trials_bound): the configured form
        batch = config.batch.model_copy(
            update={
                "global_batch_size": "auto",
                "max_global_batch_size": trials.auto_bound,
                "auto_from": "trials",
            }
        )
        config = parse_config(config.model_copy(update={"batch": batch}).model_dump(mode="json"))
    decided = plan(
        config,
        micro_batch_size=document.plan.micro_batch_size,
        samples_per_s_per_device=document.cost.samples_per_s_per_device if document.cost else None,
        trials=trials,
        trials_outcome=outcome,
        announce=False,
    )
    return replace(decided, micro_batch_source=document.micro_batch_source, explore=document.explore)
