"""The labels batchpilot puts on what it creates, in one place: on every JobSet and its pods (how a retry,
the exit handler and the orphaned-pool check find a run's and a launch's jobs), and on node pools (the GCP
resource labels that say which run holds a pool, and the node label of the TPU slice pools it made).

Under a domain batchpilot owns (Kubernetes "Labels and Selectors": a prefix is a DNS subdomain;
kubernetes.io/ and k8s.io/ are reserved). Values are the config's name (a valid label value:
`planning.names` checks it), the launch's name (`stage-K`, `final`, `stages-A-B`, `stages-A-final`: its
stages; the key keeps its name for the selectors already in use), and the first 12 hex digits of the run
document's SHA-256.

Node pools carry GCP resource labels (lowercase letters, digits, `_`, `-`; at most 63 characters): the run
holding the pool and the size to go back to when it ends.
"""

import re

RUN_LABEL = "batchpilot.dev/run"
STAGE_LABEL = "batchpilot.dev/stage"
PLAN_LABEL = "batchpilot.dev/plan"

RUN_POOL_LABEL = "batchpilot-run"
IDLE_POOL_LABEL = "batchpilot-idle-nodes"

CREATED_BY_LABEL = "batchpilot.dev/slice-of"
"""Node label (`NodeConfig.labels`) on every slice pool batchpilot creates; its value is
`cluster.node_pool`. Only pools that carry it are ever deleted."""


def label_value(text: str) -> str:
    """`text` as a GCP label value: lowercase letters, digits, `_`, `-`; at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]
