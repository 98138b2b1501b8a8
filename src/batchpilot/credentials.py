"""Google credentials for storage and the Container API, found and checked once, in seconds.

`google.auth.default` looks, in order, at the key file `GOOGLE_APPLICATION_CREDENTIALS` names, gcloud's
application-default credentials and the metadata server (Compute Engine, GKE Workload Identity). Finding
credentials proves nothing about them: a key file is read without a request, and its first access token is
fetched only by the first API call, which a client's own retries then repeat for minutes when the token
endpoint cannot be reached. So `google_credentials` fetches the first token itself, with one deadline over
every request that takes, and turns both failures (none found, no token) into one line that says which
credentials were tried and how to provide them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchpilot.errors import BatchpilotError

TOKEN_DEADLINE_S = 10.0
"""How long fetching the first access token may take, all requests and google-auth's own retries included."""
METADATA_TOKEN_DEADLINE_S = 60.0
"""The same from the metadata server, which exists only where it serves tokens (Compute Engine, GKE) but may
answer late while a new pod's Workload Identity is set up: a trainer should wait for it, not fail."""
HOW_TO_FIX = (
    "run `gcloud auth application-default login`, use Workload Identity on GKE, or set "
    "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file"
)
KEY_FILE_FIX = (
    "point GOOGLE_APPLICATION_CREDENTIALS at a service-account key file (the JSON `gcloud iam "
    "service-accounts keys create` writes), or unset it to use `gcloud auth application-default login` or "
    "Workload Identity"
)
CREDENTIAL_TYPES = (
    "service_account",
    "authorized_user",
    "external_account",
    "external_account_authorized_user",
    "impersonated_service_account",
    "gdch_service_account",
)
"""The `type`s of the credential files google-auth reads."""

_found: dict[tuple[str, ...], Any] = {}
_found_lock = threading.Lock()


def google_credentials(*, field: str, scopes: Sequence[str], deadline_s: float | None = None) -> Any:
    """Application Default Credentials holding a fresh access token (found once per process and scopes).

    Args:
        field: what needs them (a URI, a setting), to start the error line.
        scopes: OAuth scopes the token must carry.
        deadline_s: bound on fetching the first token (default: `TOKEN_DEADLINE_S`, or
            `METADATA_TOKEN_DEADLINE_S` from the metadata server).

    Raises:
        BatchpilotError: no credentials were found, or they got no token within `deadline_s`.
    """
    import google.auth
    from google.auth import exceptions

    key = tuple(sorted(scopes))
    with _found_lock:
        if key in _found:
            return _found[key]
        explicit = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
        problem = _key_file_problem(explicit) if explicit else None
        if problem:  # google-auth's own words for it are a Python tuple, or a traceback
            raise BatchpilotError(field, problem, KEY_FILE_FIX)
        try:
            credentials, _project = google.auth.default(scopes=list(scopes))
        except exceptions.DefaultCredentialsError as error:
            raise BatchpilotError(
                field, _not_found_problem(error), KEY_FILE_FIX if explicit else HOW_TO_FIX
            ) from None
        if deadline_s is None:
            from google.auth import compute_engine

            on_metadata = isinstance(credentials, compute_engine.Credentials)
            deadline_s = METADATA_TOKEN_DEADLINE_S if on_metadata else TOKEN_DEADLINE_S
        try:
            credentials.refresh(DeadlineRequest(deadline_s))
        except (exceptions.RefreshError, exceptions.TransportError) as error:
            raise BatchpilotError(
                field,
                f"the Google credentials from {credentials_source()} got no access token "
                f"({_first_line(error)})",
                f"check the network and those credentials, or {HOW_TO_FIX}",
            ) from None
        _found[key] = credentials
        return credentials


class DeadlineRequest:
    """A `google.auth.transport.Request` whose requests together end by one deadline: each gets the time left
    (google-auth's token requests otherwise wait up to 120 s each)."""

    def __init__(self, deadline_s: float) -> None:
        from google.auth.transport.requests import Request

        self._request = Request()
        self._deadline_s = deadline_s
        self._end_s = time.monotonic() + deadline_s

    def __call__(self, url: str, method: str = "GET", **kwargs: Any) -> Any:
        from google.auth import exceptions

        left_s = self._end_s - time.monotonic()
        if left_s <= 0:
            raise exceptions.TransportError(f"no answer from {url} within {self._deadline_s:g} s")
        timeout = kwargs.pop("timeout", None)
        timeout_s = left_s if timeout is None or isinstance(timeout, tuple) else min(float(timeout), left_s)
        return self._request(url, method=method, timeout=timeout_s, **kwargs)


def credentials_source() -> str:
    """Where `google.auth.default` finds credentials here, in words (its own order)."""
    explicit = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    if explicit:
        return f"GOOGLE_APPLICATION_CREDENTIALS ({explicit})"
    if gcloud_credentials_path().is_file():
        return f"gcloud application-default credentials ({gcloud_credentials_path()})"
    return "the metadata server (Compute Engine, GKE Workload Identity)"


def gcloud_credentials_path() -> Path:
    """The file `gcloud auth application-default login` writes (under CLOUDSDK_CONFIG when set)."""
    config = os.environ.get("CLOUDSDK_CONFIG") or str(Path.home() / ".config" / "gcloud")
    return Path(config) / "application_default_credentials.json"


def _key_file_problem(path: str) -> str | None:
    """Why the file GOOGLE_APPLICATION_CREDENTIALS names is no credentials file at all (not JSON, or JSON
    without a credentials `type`), or None (a missing file and a key missing fields are google-auth's to say)."""
    try:
        document = json.loads(Path(path).read_bytes())
    except OSError:
        return None
    except ValueError:
        return f"GOOGLE_APPLICATION_CREDENTIALS ({path}) holds no usable credentials: the file is not JSON"
    if not isinstance(document, dict):
        what = f"it is a JSON {type(document).__name__}"
    elif document.get("type") in CREDENTIAL_TYPES:
        return None
    elif "type" in document:
        what = f'its "type" is {document["type"]!r}'
    else:
        what = 'it has no "type"'
    return (
        f"GOOGLE_APPLICATION_CREDENTIALS ({path}) holds no usable credentials: it is not a service-account "
        f'key ({what}; a key file is a JSON object with "type": "service_account")'
    )


def _not_found_problem(error: BaseException) -> str:
    explicit = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    if explicit:  # google-auth stops at a set variable: its file is the problem
        return (
            f"GOOGLE_APPLICATION_CREDENTIALS ({explicit}) holds no usable credentials: {_error_text(error)}"
        )
    return (
        "found no Google credentials: GOOGLE_APPLICATION_CREDENTIALS is not set, "
        f"{gcloud_credentials_path()} does not exist and no metadata server answered"
    )


def _error_text(error: BaseException) -> str:
    """The error's message in words: google-auth raises (message, cause) pairs, whose `str` is a tuple."""
    args = error.args
    if len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], BaseException):
        return f"{args[0].strip().rstrip('.')}: {_error_text(args[1])}"
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
