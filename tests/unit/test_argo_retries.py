"""Which failed KFP tasks the cluster's Argo retries, from its ConfigMap (batchpilot.kfp.argo_retries)."""

from __future__ import annotations

import pytest

from batchpilot.kfp.argo_retries import retry_case


@pytest.mark.parametrize(
    ("defaults", "policy", "failed", "deleted"),
    [
        (None, "OnFailure", True, False),
        (
            "spec: {templateDefaults: {retryStrategy: {limit: '2', retryPolicy: OnError}}}",
            "OnError",
            False,
            True,
        ),
        ("spec: {templateDefaults: {retryStrategy: {retryPolicy: Always}}}", "Always", True, True),
        # RetryPolicyActual (argo-workflows workflow_types.go): an expression without a policy means Always.
        (
            "spec: {templateDefaults: {retryStrategy: {expression: 'lastRetry.status == \"Error\"'}}}",
            "Always",
            True,
            True,
        ),
        (
            "spec: {templateDefaults: {retryStrategy: {retryPolicy: OnTransientError}}}",
            "OnTransientError",
            False,
            False,
        ),
    ],
)
def test_the_policy_and_what_it_retries(defaults, policy, failed, deleted):
    case = retry_case(None if defaults is None else {"workflowDefaults": defaults})
    assert (case.policy, case.retries_failed, case.retries_deleted) == (policy, failed, deleted)


def test_a_workflow_defaults_that_is_no_mapping_is_named():
    with pytest.raises(ValueError, match=r"^workflowDefaults is no YAML mapping$"):
        retry_case({"workflowDefaults": "- a list"})
