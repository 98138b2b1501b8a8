"""Kubernetes' own rules, rewritten in Python for the cluster simulator (facts from the sources cited).

- quantities (`500m`, `32Gi`, `1e3`): k8s.io/apimachinery pkg/api/resource/quantity.go;
- container resource names: kubernetes pkg/apis/core/validation/validation.go
  (validateResourceName, validateContainerResourceName) with pkg/apis/core/helper/helpers.go
  (IsStandardContainerResourceName, IsNativeResource, IsExtendedResourceName) and
  k8s.io/apimachinery pkg/util/validation/validation.go (IsQualifiedName);
- the 422 `Status` of an invalid object: k8s.io/apimachinery pkg/api/errors (NewInvalid);
- label selectors (`a=b,c!=d,e`): k8s.io/apimachinery pkg/labels/selector.go;
- scheduling filters: kubernetes pkg/scheduler/framework/plugins/{nodeaffinity,tainttoleration,
  noderesources/fit.go,nodeunschedulable}, whose reasons make the FailedScheduling message
  `0/N nodes are available: ...` (pkg/scheduler/framework/types.go, FitError.Error).
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Any

# quantity.go: binary suffixes (powers of 2) and decimal SI suffixes; a bare exponent form `1e3`.
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Fraction | int] = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$")


def quantity(text: str | int | float) -> Fraction:
    """A Kubernetes quantity as an exact number (`"500m"` -> 1/2, `"2Gi"` -> 2147483648)."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY.pattern!r}: {text!r}")
    number, suffix = Fraction(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return (
            number * Fraction(10 ** int(suffix[1:]))
            if int(suffix[1:]) >= 0
            else number / 10 ** -int(suffix[1:])
        )
    return number * (_BINARY.get(suffix) or _DECIMAL[suffix])


# helpers.go: the resources a container may name without a domain (plus the hugepages- prefix).
STANDARD_CONTAINER_RESOURCES = {"cpu", "memory", "ephemeral-storage"}
# helpers.go standardResources: names valid without a domain anywhere (quota names included).
STANDARD_RESOURCES = STANDARD_CONTAINER_RESOURCES | {
    "requests.cpu", "requests.memory", "requests.ephemeral-storage", "limits.cpu", "limits.memory",
    "limits.ephemeral-storage", "pods", "services", "replicationcontrollers", "resourcequotas",
    "secrets", "persistentvolumeclaims", "configmaps", "storage", "requests.storage",
    "services.nodeports", "services.loadbalancers",
}  # fmt: skip
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def qualified_name_errors(value: str) -> list[str]:
    """IsQualifiedName: `[prefix/]name`, prefix a DNS-1123 subdomain, name at most 63 characters."""
    prefix, _, name = value.rpartition("/")
    errors = []
    if value.count("/") > 1:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must "
                "start and end with an alphanumeric character with an optional DNS subdomain prefix and '/'"]  # fmt: skip
    if "/" in value and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        errors.append("prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                      "characters, '-' or '.', and must start and end with an alphanumeric character")  # fmt: skip
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    elif not _NAME_PART.match(name):
        errors.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
                      "and end with an alphanumeric character")  # fmt: skip
    return errors


def dns1123_label_errors(value: str) -> list[str]:
    """IsDNS1123Label's messages (k8s.io/apimachinery pkg/util/validation/validation.go)."""
    errors = []
    if len(value) > 63:
        errors.append("must be no more than 63 characters")
    if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", value):
        errors.append("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                      "and must start and end with an alphanumeric character")  # fmt: skip
    return errors


def is_native_resource(name: str) -> bool:
    """IsNativeResource: no domain, or a `kubernetes.io/` one."""
    return "/" not in name or "kubernetes.io/" in name


def is_extended_resource_name(name: str) -> bool:
    """IsExtendedResourceName: a domain outside kubernetes.io, and `requests.<name>` is qualified."""
    if is_native_resource(name) or name.startswith("requests."):
        return False
    return not qualified_name_errors(f"requests.{name}")


def container_resource_name_errors(name: str) -> list[str]:
    """validateContainerResourceName's messages for one key of `resources.limits` / `requests`."""
    errors = qualified_name_errors(name)
    if "/" not in name:
        if name not in STANDARD_RESOURCES and not name.startswith("hugepages-"):
            errors.append("must be a standard resource type or fully qualified")
        if name not in STANDARD_CONTAINER_RESOURCES and not name.startswith("hugepages-"):
            errors.append("must be a standard resource for containers")
    elif not is_native_resource(name) and not is_extended_resource_name(name):
        errors.append("doesn't follow extended resource name standard")
    return errors


def pod_spec_errors(spec: dict[str, Any], path: str = "spec") -> list[tuple[str, str, str]]:
    """(field, value, message) for every invalid resource name or extended-resource quantity, and a
    hostname or subdomain that is not a DNS-1123 label (ValidatePodSpec; IsDNS1123Label)."""
    found = []
    for key in ("hostname", "subdomain"):
        if value := spec.get(key):
            found += [(f"{path}.{key}", value, message) for message in dns1123_label_errors(value)]
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            resources = container.get("resources") or {}
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            for section, values in (("limits", limits), ("requests", requests)):
                for name, value in values.items():
                    field = f"{path}.{kind}[{i}].resources.{section}[{name}]"
                    found += [(field, name, message) for message in container_resource_name_errors(name)]
                    # ValidateResourceRequirements: extended resources are whole numbers...
                    if is_extended_resource_name(name) and quantity(value).denominator != 1:
                        found.append((field, str(value), "must be an integer"))
            for name, value in requests.items():
                # ...and cannot be overcommitted: a request needs an equal limit.
                if is_extended_resource_name(name) and name not in limits:
                    field = f"{path}.{kind}[{i}].resources.limits"
                    found.append((field, name, "Limit must be set for non overcommitable resources"))
                elif is_extended_resource_name(name) and quantity(limits[name]) != quantity(value):
                    field = f"{path}.{kind}[{i}].resources.requests[{name}]"
                    found.append((field, str(value), f"must be equal to {name} limit of {limits[name]}"))
    return found


class Invalid(Exception):
    """The API server's 422 for an object that fails validation; `status` is the Status body."""

    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__(status["message"])
        self.status = status


def invalid_status(kind: str, name: str, errors: list[tuple[str, str, str]]) -> dict[str, Any]:
    """The 422 Status the API server answers (NewInvalid: one error bare, several in brackets)."""
    parts = [f'{field}: Invalid value: "{value}": {message}' for field, value, message in errors]
    joined = parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f'{kind} "{name}" is invalid: {joined}', "reason": "Invalid", "code": 422,
        "details": {"name": name, "kind": kind.lower() + "s", "causes": [
            {"reason": "FieldValueInvalid", "message": f'Invalid value: "{value}": {message}', "field": field}
            for field, value, message in errors
        ]},
    }  # fmt: skip


def selector_matches(labels: dict[str, str], selector: str) -> bool:
    """labels.Parse subset: `k=v`, `k==v`, `k!=v`, `k` (exists), `!k`, `k in (a,b)`, `k notin (a,b)`."""
    for term in re.findall(r"[^,(]+(?:\([^)]*\))?", selector):
        term = term.strip()
        if not term:
            continue
        if match := re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", term):
            key, op, values = match.group(1), match.group(2), {v.strip() for v in match.group(3).split(",")}
            if (op == "in") != (key in labels and labels[key] in values):
                return False
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """ToleratesTaint (k8s.io/api core/v1 toleration.go): empty effect/key match all; Exists ignores value."""
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def _container_requests(container: dict[str, Any]) -> dict[str, Fraction]:
    """One container's requests (a limit alone implies the request: ValidateResourceRequirements' defaulting)."""
    resources = container.get("resources") or {}
    asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: quantity(value) for name, value in asked.items()}


def _add(total: dict[str, Fraction], more: dict[str, Fraction]) -> None:
    for name, value in more.items():
        total[name] = total.get(name, Fraction(0)) + value


def pod_requests(spec: dict[str, Any]) -> dict[str, Fraction]:
    """The pod's effective requests as the scheduler counts them (k8s.io/component-helpers resource/helpers.go,
    PodRequests and AggregateContainerRequests; the sidecar KEP 753's "Resources calculation for scheduling"):
    the app containers summed, with every restartable init container (a sidecar, `restartPolicy: Always`)
    added; each other init container runs alone with the sidecars started before it, and the pod needs the
    largest of those per resource if it is more; then the pod's `overhead` is added."""
    total: dict[str, Fraction] = {}
    for container in spec.get("containers") or []:
        _add(total, _container_requests(container))
    sidecars: dict[str, Fraction] = {}
    init_peak: dict[str, Fraction] = {}
    for container in spec.get("initContainers") or []:
        own = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            running = dict(sidecars)
        else:
            running = dict(own)
            _add(running, sidecars)
        for name, value in running.items():
            init_peak[name] = max(init_peak.get(name, Fraction(0)), value)
    for name, value in init_peak.items():
        total[name] = max(total.get(name, Fraction(0)), value)
    _add(total, {name: quantity(value) for name, value in (spec.get("overhead") or {}).items()})
    return total


def required_affinity_matches(spec: dict[str, Any], labels: dict[str, str]) -> bool:
    """The pod's required node affinity against a node's labels (component-helpers scheduling/corev1/
    nodeaffinity: the nodeSelectorTerms are ORed, a term's matchExpressions ANDed; In, NotIn, Exists,
    DoesNotExist, Gt, Lt as labels.Selector has them: NotIn and DoesNotExist match a node without the key).
    matchFields (metadata.name only) are not simulated."""
    terms = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms")
    )
    if not terms:
        return True

    def matches(expression: dict[str, Any]) -> bool:
        key, op, values = expression["key"], expression["operator"], expression.get("values") or []
        present, value = key in labels, labels.get(key)
        if op == "In":
            return present and value in values
        if op == "NotIn":
            return not present or value not in values
        if op == "Exists":
            return present
        if op == "DoesNotExist":
            return not present
        if op in ("Gt", "Lt") and present and value is not None and value.isdigit():
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        return False

    return any(all(matches(e) for e in term.get("matchExpressions") or []) for term in terms)


def unfit_reasons(pod: dict[str, Any], node: dict[str, Any], used: dict[str, Fraction]) -> list[str]:
    """Why the scheduler's filters reject `node` for `pod` (empty: it fits), in the plugins' words.

    The filters run in the default order (pkg/scheduler/apis/config/v1/default_plugins.go:
    NodeUnschedulable, TaintToleration, NodeAffinity, NodeResourcesFit) and a node's reasons are those
    of the first that rejects it; NodeResourcesFit names every resource that is short."""
    spec, labels = pod["spec"], node["metadata"].get("labels", {})
    if node["spec"].get("unschedulable"):
        return ["node(s) were unschedulable"]  # nodeunschedulable.ErrReasonUnschedulable
    for taint in node["spec"].get("taints") or []:
        if taint["effect"] in ("NoSchedule", "NoExecute") and not any(
            tolerates(t, taint) for t in spec.get("tolerations") or []
        ):  # tainttoleration.ErrReasonNotMatch
            return [f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"]
    if any(
        labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()
    ) or not required_affinity_matches(spec, labels):
        return ["node(s) didn't match Pod's node affinity/selector"]  # nodeaffinity.ErrReasonPod
    allocatable = {k: quantity(v) for k, v in node["status"].get("allocatable", {}).items()}
    reasons = []
    for name, amount in sorted(pod_requests(spec).items()):
        if amount > allocatable.get(name, Fraction(0)) - used.get(name, Fraction(0)):
            reasons.append(f"Insufficient {name}")  # noderesources fit.go
    return reasons


def failed_scheduling_message(num_nodes: int, per_node: list[list[str]]) -> str:
    """FitError.Error(): `0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) ...`, then
    what DefaultPreemption (the PostFilter) found for a pod with no lower-priority victims: a node
    short of resources has "No preemption victims found for incoming pod", any other node is one where
    "Preemption is not helpful for scheduling" (pkg/scheduler/framework/preemption/preemption.go)."""
    if num_nodes == 0:
        return "no nodes available to schedule pods"

    def histogram(items: list[str]) -> str:
        return ", ".join(sorted(f"{n} {reason}" for reason, n in Counter(items).items()))

    reasons = [reason for node in per_node for reason in node]
    after = ["No preemption victims found for incoming pod" if node[0].startswith("Insufficient")
             else "Preemption is not helpful for scheduling" for node in per_node]  # fmt: skip
    return (
        f"0/{num_nodes} nodes are available: {histogram(reasons)}. "
        f"preemption: 0/{num_nodes} nodes are available: {histogram(after)}."
    )
