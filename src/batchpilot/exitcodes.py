"""Exit codes that mean something to whoever runs batchpilot (pipelines, launchers, schedulers)."""

EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: the trainer got SIGTERM, checkpointed at a micro-batch boundary and stopped; run the same
stage again to resume exactly."""

PREEMPTED_LOG_MARKER = f"preempted: exit {EXIT_PREEMPTED}"
"""Rank 0 logs this line when it stops for preemption; launchers look for it (torchrun itself exits 1)."""
