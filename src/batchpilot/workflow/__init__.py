"""The pipeline's steps, one module each, as typed functions: explore, plan, pool, canary, capacity, stage,
trials (and trial_runs), report; `timeouts` bounds each task.

The `batchpilot` commands, the KFP components and the local run all call these functions; none of them
decides anything these functions decide. The run document (`plan.json`, `batchpilot.plan.rundoc`) is what
the steps pass along: `plan` makes it, every later step reads it. Progress goes to the `batchpilot.workflow`
loggers; entry points choose what reaches a console.
"""
