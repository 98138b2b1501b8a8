"""Node pools and launchers: where and how the trainers of a stage run.

- `nodepool`: the `NodePool` interface and `node_pool_for(config)` (local processes or a GKE pool).
- `gke`, `readiness`: the GKE pool through the Container API; node readiness through the Kubernetes API.
- `launch`: a stage as a torchx AppDef, run with `local_cwd`, as a JobSet (`jobset`) or a Volcano Job.
- `placement`: node selector, tolerations and pod settings of trainers (the pipeline reuses them).
"""
