"""How the cluster's Argo retries a KFP task, read from its workflow-controller-configmap (kfp- and
kubernetes-free: `batchpilot doctor` feeds it the ConfigMap's `workflowDefaults`).

What decides it (facts from the sources named):
- KFP compiles a task's retry policy into its executor pod template's `retryStrategy` with a limit and a
  backoff, never a `retryPolicy` (kubeflow/pipelines backend/src/v2/compiler/argocompiler/container.go,
  getTaskRetryStrategyFromInput);
- Argo merges `workflowDefaults.spec.templateDefaults` into every template by strategic merge patch, the
  template's own fields winning and the missing ones filled in (argo-workflows workflow/controller/
  operator.go, mergedTemplateDefaultsInto; docs/template-defaults.md): a KFP task's retry policy is
  therefore the templateDefaults' `retryStrategy.retryPolicy`, and with none Argo's default, OnFailure
  (pkg/apis/workflow/v1alpha1/workflow_types.go, RetryPolicyActual: OnFailure without an expression);
- which attempts a policy retries (operator.go, processNodeRetries): Always a Failed and an Errored one,
  OnFailure only a Failed one, OnError only an Errored one, OnTransientError only one whose message is
  a transient error (a quota, a timeout, a network error);
- a task that exits non-zero is Failed (its main container's exit code, operator.go inferFailedReason);
  a task pod deleted before the controller saw it end (a node drain or upgrade, a Spot reclaim of the
  task's node) is Errored, "pod deleted" (operator.go, podReconciliation);
- KFP's manifests set `templateDefaults.retryStrategy: {limit: 2, retryPolicy: OnError}` from 2.17.0
  (kubeflow/pipelines #13485, manifests/kustomize/third-party/argo/base/workflow-controller-configmap-
  patch.yaml), in ConfigMap `workflow-controller-configmap` of KFP's namespace (`kubeflow`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONFIGMAP = "workflow-controller-configmap"
DEFAULTS_KEY = "workflowDefaults"
POLICY_PATH = "workflowDefaults.spec.templateDefaults.retryStrategy.retryPolicy"
RETRIED = {
    "Always": ("Failed", "Error"),
    "OnFailure": ("Failed",),
    "OnError": ("Error",),
    "OnTransientError": (),
}
"""The phases of a failed attempt each retry policy retries (OnTransientError: only transient errors)."""


@dataclass(frozen=True)
class RetryCase:
    """The retry policy a KFP task with retries runs under, and where it comes from."""

    policy: str
    source: str

    @property
    def retries_failed(self) -> bool:
        """A task that exits non-zero (exit 75 after an eviction, a failed resize or launch) is retried."""
        return "Failed" in RETRIED[self.policy]

    @property
    def retries_deleted(self) -> bool:
        """A task whose pod was deleted before it ended (a drain, an upgrade, a Spot reclaim) is retried."""
        return "Error" in RETRIED[self.policy]


def retry_case(config_map_data: dict[str, str] | None) -> RetryCase:
    """The case of a cluster whose Argo ConfigMap holds `config_map_data` (None: no ConfigMap). Raises
    ValueError, naming the key, on a `workflowDefaults` that is no YAML mapping or an unknown policy."""
    import yaml

    text = (config_map_data or {}).get(DEFAULTS_KEY)
    if not text:
        where = "no workflowDefaults" if config_map_data is not None else f"no {CONFIGMAP}"
        return RetryCase("OnFailure", f"Argo's default ({where})")
    try:
        defaults: Any = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{DEFAULTS_KEY} is no YAML: {' '.join(str(error).split())}") from None
    if not isinstance(defaults, dict):
        raise ValueError(f"{DEFAULTS_KEY} is no YAML mapping")
    strategy = (((defaults.get("spec") or {}).get("templateDefaults") or {}).get("retryStrategy")) or {}
    policy = strategy.get("retryPolicy")
    if not policy:
        if strategy.get("expression"):  # RetryPolicyActual: an expression alone makes it Always
            return RetryCase("Always", f"{DEFAULTS_KEY}'s templateDefaults retryStrategy.expression")
        return RetryCase("OnFailure", f"Argo's default (no retryPolicy in {DEFAULTS_KEY}'s templateDefaults)")
    if policy not in RETRIED:
        raise ValueError(f"{POLICY_PATH} is {policy!r}, which Argo refuses (valid: {', '.join(RETRIED)})")
    return RetryCase(str(policy), POLICY_PATH)
