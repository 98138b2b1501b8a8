"""`batchpilot trials`: run the batch trials of a plan (warm-up, branches, decision) and write the decided plan.

The console shows one line as each branch starts and one as it ends (its final validation loss, or FAILED
and why), then the decision; the trainers' own lines come in between.
"""

from __future__ import annotations

import argparse
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchpilot.commands.options import add_out
from batchpilot.errors import BatchpilotError
from batchpilot.files import check_output_dir


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trials",
        help="race candidate global batches and LRs on validation loss from one warm-up checkpoint",
        description="Trains the plan's batch trials (trials.enabled): a warm-up at the ramp's start batch, then "
        "one short branch per candidate batch and LR multiplier from its checkpoint, all over the same samples, "
        "and decides the critical batch from their validation losses. Writes OUT/trials.json (every branch's "
        "curve and the decision) and OUT/plan.json (the run's plan made again with the decision). Locally each "
        "branch is a torchx launch of its nodes x devices_per_node processes.",
    )
    parser.add_argument(
        "--plan",
        required=True,
        metavar="FILE",
        help="the run document (plan.json of `batchpilot plan --out`)",
    )
    add_out(
        parser,
        required=True,
        metavar="DIR",
        help="the folder for trials.json, the decided plan.json and each branch's metrics and logs",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="branches trained at once (default: trials.parallelism, locally at most the CPUs over each "
        "branch's processes)",
    )
    parser.set_defaults(handler=run)


def default_parallel(*, parallelism: int, backend: str, processes_per_branch: int, cpus: int) -> int:
    """trials.parallelism, locally at most the CPUs over the largest branch's processes (at least one)."""
    if backend != "local":
        return parallelism
    return max(1, min(parallelism, cpus // processes_per_branch))


def run(args: argparse.Namespace) -> int:
    from batchpilot.plan.rundoc import read_run_document
    from batchpilot.planning.trials import BranchResult, TrialBranch
    from batchpilot.workflow.trial_runs import decide_trials, run_branch, run_warmup
    from batchpilot.workflow.trials import TRIALS_FILE, keep_trials_record, planned_trials

    document = read_run_document(args.plan)
    plan = planned_trials(document)
    if args.parallel is not None and args.parallel < 1:
        raise BatchpilotError("--parallel", f"is {args.parallel}", "give at least 1")
    out = check_output_dir(args.out, field="--out")
    out.mkdir(parents=True, exist_ok=True)
    config = document.config
    work_dir = out.absolute() if config.cluster.backend == "local" else None
    processes = max(b.num_nodes for b in plan.branches) * config.cluster.devices_per_node
    parallel = args.parallel or default_parallel(
        parallelism=plan.parallelism, backend=config.cluster.backend, processes_per_branch=processes,
        cpus=os.cpu_count() or 1,
    )  # fmt: skip

    run_warmup(document, work_dir=work_dir)
    lock = threading.Lock()

    def say(line: str) -> None:  # one whole line at a time from the branches' threads
        with lock:
            print(line, flush=True)

    def one(branch: TrialBranch) -> BranchResult:
        say(
            f"> {branch.name}: batch {branch.global_batch_size}, LR {branch.lr:.4g} on {branch.num_nodes} node(s)"
        )
        result = run_branch(document, index=branch.index, work_dir=work_dir)
        if result.final_loss is not None:
            say(
                f"< {branch.name}: batch {branch.global_batch_size}, LR {branch.lr:.4g}: validation loss "
                f"{result.final_loss:.4f} after {result.curve[-1][0]:,} samples"
            )
        else:
            say(
                f"< {branch.name}: batch {branch.global_batch_size}, LR {branch.lr:.4g}: FAILED: {result.reason}"
            )
        return result

    print(f"trials: {len(plan.branches)} branch(es), {parallel} at once")
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        results = list(pool.map(one, plan.branches))
    decided = decide_trials(document, results)
    keep_trials_record(out, decided)
    assert decided.trials_outcome is not None
    decision = decided.trials_outcome.decision
    for excluded in decision.excluded:
        print(f"excluded: {excluded}")
    print(f"decision: {decision.reason}")
    final = decided.plan.stages[-1]
    print(f"the run's target: global batch {final.global_batch_size} at LR {final.lr:.4g}")
    print(f"wrote {out / TRIALS_FILE}, {out / 'plan.json'}")
    return 0
