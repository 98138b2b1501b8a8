"""Container image references: the one image every pipeline task and trainer pod runs.

A cluster pulls an image by its full reference, `REGISTRY/PATH[:TAG][@DIGEST]`. A reference without a
registry host (`batchpilot:0.1.0`) is resolved by the node's container runtime to Docker Hub, which
does not hold batchpilot, so a cluster run refuses it before anything is submitted.
"""

from __future__ import annotations

import re

from batchpilot.errors import BatchpilotError

# The reference grammar of the OCI distribution spec: path components, an optional tag and digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"^(?P<name>(?:(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?)/)?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?$"
)


def check_image(image: str, *, field: str, cluster: bool) -> str:
    """`image` when it is a valid reference (and, for a cluster, names its registry); else a one-line error.

    Args:
        image: e.g. `us-docker.pkg.dev/p/r/batchpilot:0.1.0` or `REGISTRY/batchpilot@sha256:...`.
        field: the setting or option it came from, for the error.
        cluster: the image will be pulled by cluster nodes, so it must name its registry host.
    """
    match = _REFERENCE.match(image)
    if match is None:
        raise BatchpilotError(
            field,
            f"{image!r} is not a container image reference",
            "write REGISTRY/PATH:TAG or REGISTRY/PATH@sha256:DIGEST",
        )
    host = match.group("host")
    qualified = host is not None and ("." in host or ":" in host or host == "localhost")
    if cluster and not qualified:
        raise BatchpilotError(
            field,
            f"{image!r} names no registry, so GKE nodes would look for it on Docker Hub",
            "push the batchpilot image to your registry and give its full reference, e.g. "
            "us-docker.pkg.dev/PROJECT/REPO/batchpilot:0.1.0 (a @sha256: digest pins it)",
        )
    return image
