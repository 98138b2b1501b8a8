"""The KFP API: its health check answers, and its backend is recent enough for the pipeline."""

from __future__ import annotations

import json
import re

from batchpilot.doctor.core import CALL_TIMEOUT_S, Check, Context, fail, ok, skip

MIN_KFP_BACKEND = (2, 14, 0)
"""The resize and train tasks sit in each launch's sub-pipeline, and KFP's Argo compiler gives a task in a nested
pipeline its retry policy only from 2.14.0 (kubeflow/pipelines #11908, "implement retryStrategy for nested
pipelines"); docs/cluster.md, "KFP version"."""


def check_kfp(context: Context) -> Check:
    """The KFP API answers its health check, and its backend is recent enough for the pipeline."""
    import kfp_server_api

    from batchpilot.kfp.submit import _talking_to, check_host

    if not context.kfp_host:
        return skip("kfp", "no --host (the KFP API endpoint, as for batchpilot submit)")
    host = check_host(context.kfp_host)
    configuration = kfp_server_api.Configuration(host=host)
    configuration.retries = False
    if context.kfp_token:
        configuration.api_key["authorization"] = context.kfp_token
        configuration.api_key_prefix["authorization"] = "Bearer"
    api = kfp_server_api.HealthzServiceApi(kfp_server_api.ApiClient(configuration))
    with _talking_to(host, "check the API (GET /apis/v2beta1/healthz)"):  # submit's one-line errors
        response = api.healthz_service_get_healthz(_request_timeout=CALL_TIMEOUT_S, _preload_content=False)
    tag = str(json.loads(response.data).get("tag_name") or "unknown")
    numbers = tuple(int(n) for n in re.findall(r"\d+", tag)[:3])
    minimum = ".".join(map(str, MIN_KFP_BACKEND))
    if len(numbers) < 2:
        return ok(
            "kfp",
            f"{host} answers; its backend does not say its version (tag_name {tag!r}): batchpilot needs {minimum} or later",
        )
    if numbers < MIN_KFP_BACKEND:
        return fail(
            "kfp",
            f"{host} runs KFP {tag}, older than {minimum}: its Argo compiler drops the retry policy of a task inside a "
            "nested pipeline, so a failed resize or stage (each launch's group) would never be retried",
            f'upgrade the KFP backend to {minimum} or later (docs/cluster.md, "KFP version")',
        )
    return ok("kfp", f"{host} answers; backend {tag} ({minimum} or later)")
