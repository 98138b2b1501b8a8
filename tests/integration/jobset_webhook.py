"""The JobSet validating webhook's name rules on create, and how the API server answers a denial.

Written from the sources, independently of batchpilot's own `cluster/names.py` (a stand-in that shared
the code under test could not catch its mistakes):

- metadata.name: the API server validates every custom resource's metadata with `NameIsDNSSubdomain`
  (k8s.io/apiextensions-apiserver pkg/registry/customresource/strategy.go, Validate ->
  ValidateObjectMetaAccessor) before validating admission webhooks run (k8s.io/apiserver
  pkg/registry/generic/registry/store.go, Create: BeforeCreate, then createValidation); its refusal is the
  API server's own 422 `JobSet.jobset.x-k8s.io "NAME" is invalid: metadata.name: Invalid value: ...`.
- The webhook (kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go, ValidateCreate, commit 08dfbdf),
  after its defaulting webhook and the CRD defaults (groupName "default", replicas 1, completionMode
  Indexed: `Default` in the same file, api/jobset/v1alpha2/jobset_types.go):
  - spec.network.subdomain: IsDNS1123Subdomain, and IsDNS1035Label since it also names the headless
    service (a too-long message becomes `subdomainTooLongErrMsg`);
  - each replicated Job: groupName IsDNS1035Label; the longest Job name `<jobset>-<rjob>-<replicas - 1>`
    (placement.GenJobName) IsDNS1035Label (`jobNameTooLongErrorMsg`); for an Indexed Job with completions,
    the longest pod name `<jobset>-<rjob>-<max job index>-<max pod index>` (placement.GenPodName) + "-abcde"
    IsDNS1035Label (`podNameTooLongErrorMsg`; the error carries the Job name as its value, as the source does);
  - the errors become one `apierrors.NewInvalid(JobSet.jobset.x-k8s.io, name, errs)` (invalidError).
- The denial's way back: controller-runtime's validating handler turns an APIStatus error into the
  AdmissionResponse's Status (pkg/webhook/admission/validator_custom.go: `validationResponseFromStatus(false,
  apiStatus.Status())`), and the API server answers the client with that Status, code kept (>= 400), its
  message prefixed `admission webhook "vjobset.kb.io" denied the request: ` (k8s.io/apiserver
  pkg/admission/plugin/webhook/errors/statuserror.go, ToStatusErr); the webhook's name is from the
  kubebuilder marker in jobset_webhook.go (`name=vjobset.kb.io`). So the real `kubernetes` client raises
  ApiException 422, reason Invalid, with that message.
- Messages of IsDNS1123Subdomain / IsDNS1035Label: k8s.io/apimachinery pkg/util/validation/validation.go
  (MaxLenError, RegexError with the examples); field errors read `FIELD: Invalid value: "VALUE": MESSAGE`
  (pkg/util/validation/field/errors.go), several joined as `[e1, e2]` (an aggregate).
"""

from __future__ import annotations

import re
from typing import Any

WEBHOOK = "vjobset.kb.io"
QUALIFIED_KIND = "JobSet.jobset.x-k8s.io"

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
TOO_LONG_63 = "must be no more than 63 characters"
DNS1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
DNS1123_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
# jobset_webhook.go's constants.
SUBDOMAIN_TOO_LONG = ".spec.network.subdomain is too long, must be less than 63 characters"
GROUP_NAME_TOO_LONG = ".spec.replicatedJob[].groupName is too long, must be less than 63 characters"
JOB_NAME_TOO_LONG = "JobSet name is too long, job names generated for this JobSet will exceed 63 characters"
POD_NAME_TOO_LONG = "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters"

FieldError = tuple[str, str, str]  # (field path, value, message)


def is_dns1035_label(value: str) -> list[str]:
    """IsDNS1035Label's messages."""
    found = [TOO_LONG_63] if len(value) > 63 else []
    return found + ([] if _DNS1035.fullmatch(value) else [DNS1035_MESSAGE])


def is_dns1123_subdomain(value: str) -> list[str]:
    """IsDNS1123Subdomain's messages."""
    found = ["must be no more than 253 characters"] if len(value) > 253 else []
    return found + ([] if _DNS1123_SUBDOMAIN.fullmatch(value) else [DNS1123_SUBDOMAIN_MESSAGE])


def _dns1035(path: str, value: str, too_long: str) -> list[FieldError]:
    return [(path, value, too_long if m == TOO_LONG_63 else m) for m in is_dns1035_label(value)]


def name_errors(jobset: dict[str, Any]) -> list[FieldError]:
    """The API server's own check of metadata.name (before any webhook)."""
    name = jobset.get("metadata", {}).get("name", "")
    return [("metadata.name", name, message) for message in is_dns1123_subdomain(name)]


def webhook_errors(jobset: dict[str, Any]) -> list[FieldError]:
    """ValidateCreate's name rules on a defaulted JobSet, in the source's order."""
    name = jobset["metadata"]["name"]
    spec = jobset.get("spec", {})
    found: list[FieldError] = []
    subdomain = (spec.get("network") or {}).get("subdomain") or ""
    if subdomain:
        path = "spec.network.subdomain"
        found += [(path, subdomain, m) for m in is_dns1123_subdomain(subdomain)]
        found += _dns1035(path, subdomain, SUBDOMAIN_TOO_LONG)
    for index, rjob in enumerate(spec.get("replicatedJobs") or []):
        path = f"spec.replicatedJobs[{index}]"
        found += _dns1035(f"{path}.groupName", rjob.get("groupName", "default"), GROUP_NAME_TOO_LONG)
        replicas = int(rjob.get("replicas", 1))
        job = f"{name}-{rjob['name']}-{replicas - 1}"  # placement.GenJobName
        found += _dns1035(f"{path}.name", job, JOB_NAME_TOO_LONG)
        job_spec = rjob["template"]["spec"]
        indexed = job_spec.get("completionMode", "Indexed") == "Indexed"  # the defaulting webhook's default
        if indexed and job_spec.get("completions") is not None:
            pod = f"{name}-{rjob['name']}-{replicas - 1}-{int(job_spec['completions']) - 1}-abcde"
            found += [(f"{path}.name", job, m) for _, _, m in _dns1035("", pod, POD_NAME_TOO_LONG)]
    return found


def invalid(name: str, errors: list[FieldError], *, webhook: str | None) -> dict[str, Any]:
    """The 422 Status the client receives: NewInvalid's, prefixed by ToStatusErr when a webhook denied."""
    parts = [f'{field}: Invalid value: "{value}": {message}' for field, value, message in errors]
    joined = parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"
    message = f'{QUALIFIED_KIND} "{name}" is invalid: {joined}'
    if webhook:
        message = f'admission webhook "{webhook}" denied the request: {message}'
    causes = [
        {"reason": "FieldValueInvalid", "message": f'Invalid value: "{value}": {text}', "field": field}
        for field, value, text in errors
    ]
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
        "reason": "Invalid", "code": 422,
        "details": {"name": name, "group": "jobset.x-k8s.io", "kind": "JobSet", "causes": causes},
    }  # fmt: skip


def admit_create(jobset: dict[str, Any]) -> dict[str, Any] | None:
    """None when the JobSet may be created, else the 422 Status the API server answers."""
    name = str(jobset.get("metadata", {}).get("name", ""))
    if errors := name_errors(jobset):
        return invalid(name, errors, webhook=None)
    if errors := webhook_errors(jobset):
        return invalid(name, errors, webhook=WEBHOOK)
    return None
