"""The labels on every JobSet batchpilot creates and on its pods: how a retry, the exit handler and the
orphaned-pool check find a run's and a launch's jobs.

Under a domain batchpilot owns (Kubernetes "Labels and Selectors": a prefix is a DNS subdomain;
kubernetes.io/ and k8s.io/ are reserved). Values are the config's name (a valid label value:
`planning.names` checks it), the launch's name (`stage-K`, `final`, `stages-A-B`, `stages-A-final`: its
stages; the key keeps its name for the selectors already in use), and the first 12 hex digits of the run
document's SHA-256.
"""

RUN_LABEL = "batchpilot.dev/run"
STAGE_LABEL = "batchpilot.dev/stage"
PLAN_LABEL = "batchpilot.dev/plan"
