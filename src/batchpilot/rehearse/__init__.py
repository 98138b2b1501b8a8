"""`batchpilot rehearse`: the user's own KFP, Argo, JobSet and GKE, exercised once by a tiny run.

No review of the systems' sources settles how one cluster behaves. The rehearsal compiles the same
pipeline for a tiny model on a small, cheap node pool the user names, submits it to the cluster's KFP and
watches and disturbs it as a long run would be disturbed, reporting one line per thing it checks:

- `shape.py`: the rehearsal's config, derived from the user's (pure: its data and checkpoints under a
  prefix of their own, a paced tiny model whose stages last long enough to disturb);
- `cluster.py`: what it reads and does on the cluster (KFP runs, JobSets, pods and their logs, the pool's
  size, ProvisioningRequests, checkpoints);
- `steps.py`: the checks in order, each bounded, each one line.
"""
