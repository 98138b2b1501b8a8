"""Exit codes that mean something to whoever runs batchpilot (pipelines, launchers, schedulers)."""

EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: the trainer got SIGTERM, checkpointed at the end of a step and stopped; run the same
stage again to resume exactly."""

PREEMPTED_LOG_MARKER = f"preempted: exit {EXIT_PREEMPTED}"
"""Rank 0 logs this line when it stops for preemption; launchers look for it (torchrun itself exits 1)."""

PREEMPTED_FILE = "preempted"
"""Every rank that stops for preemption writes this file into its `--out` folder: a pod's command turns
torchrun's exit 1 into EXIT_PREEMPTED when it finds it, so Kubernetes can tell a preemption by exit code."""

CANARY_FAILED_MARKER = "batchpilot canary failed:"
"""A canary rank that fails prints one line starting with this (what failed, where); the canary task picks
the first such line out of the job's log and fails with it (torchrun's own exit code says nothing)."""

REFUSAL_LOG_MARKER = "batchpilot: error: "
"""What the CLI prints before a refusal's one line (exit 2, `cli.main`); a launch that finds it in its
trainers' output reports that line as its own and exits 2 (`cluster.launch.follow`)."""
