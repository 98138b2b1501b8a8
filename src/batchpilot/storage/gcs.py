"""GCS storage through google-cloud-storage: ranged reads, pinned generations, retries, checksums.

Transient failures (408, 429, 5xx, dropped or cut-short connections) are retried with exponential backoff
and jitter by a `google.api_core.retry.Retry` wrapped around each whole client call (the client's own
retry is off): some transport errors, such as a truncated error body, surface outside the client's retry. Whole-object reads are verified against the server's CRC32C by the
client; ranged reads cannot be (GCS has no per-range checksum), which is why a shard set compares every
shard's CRC32C with its manifest when it is opened and pins the generation it checked.

With `STORAGE_EMULATOR_HOST` set (tests, fake-gcs-server) the client uses anonymous credentials; otherwise
Application Default Credentials, checked once with a bounded first token request (`batchpilot.credentials`).
"""

from __future__ import annotations

import base64
import http.client
import os
import threading
from typing import Any

import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exceptions
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from batchpilot.credentials import google_credentials
from batchpilot.storage.protocol import (
    GenerationChanged,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    join_uri,
)

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRYABLE_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    http.client.IncompleteRead,
    http.client.RemoteDisconnected,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    # A body that does not match the server's checksum was damaged in transit; the stored object is
    # checked against the manifest separately.
    DataCorruption,
)


def is_transient(error: BaseException) -> bool:
    """Whether a GCS call that raised `error` is worth repeating."""
    if isinstance(error, _RETRYABLE_TYPES):
        return True
    if isinstance(error, api_exceptions.GoogleAPICallError):
        return error.code in _RETRYABLE_STATUS
    if isinstance(error, InvalidResponse):
        return error.response.status_code in _RETRYABLE_STATUS
    if isinstance(error, auth_exceptions.TransportError) and error.args:
        return isinstance(error.args[0], BaseException) and is_transient(error.args[0])
    return False


def transient_retry(
    *, initial_delay_s: float = 0.1, max_delay_s: float = 5.0, deadline_s: float = 120.0
) -> Retry:
    """Exponential backoff with jitter on transient errors, giving up after `deadline_s`."""
    return Retry(
        predicate=is_transient,
        initial=initial_delay_s,
        maximum=max_delay_s,
        multiplier=2.0,
        timeout=deadline_s,
    )


def crc32c_from_base64(value: str | None) -> int | None:
    """GCS reports CRC32C as base64 of the big-endian 4 bytes."""
    return int.from_bytes(base64.b64decode(value), "big") if value else None


UPLOAD_CHUNK_BYTES = 32 * 1024 * 1024
"""Chunk of a resumable upload: a failed chunk is sent again from the last byte GCS kept, not the whole
object (a multiple of 256 KiB, as GCS requires)."""
_ONE_REQUEST_MAX_BYTES = 8 * 1024 * 1024
"""google-cloud-storage uploads objects up to this size in one (multipart) request, larger ones resumably."""


class GCSStorage:
    """Objects under `gs://bucket/prefix`. Safe to use from several threads (one client per thread).

    Objects over 8 MiB written without a generation precondition (checkpoint files) go up as resumable
    uploads in chunks of `upload_chunk_bytes`; the client retries a failed chunk and resumes where GCS
    stopped. Smaller objects, and conditional writes, are one request retried whole.
    """

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str,
        retry: Retry | None = None,
        timeout_s: float = 60.0,
        upload_chunk_bytes: int = UPLOAD_CHUNK_BYTES,
    ) -> None:
        if upload_chunk_bytes % (256 * 1024):
            raise ValueError(f"upload_chunk_bytes must be a multiple of 256 KiB, got {upload_chunk_bytes}")
        self._bucket_name = bucket
        self._prefix = f"{prefix}/" if prefix else ""
        self._retry = retry or transient_retry()
        self._timeout_s = timeout_s
        self._upload_chunk_bytes = upload_chunk_bytes
        self._local = threading.local()

    @property
    def uri(self) -> str:
        return f"gs://{self._bucket_name}/{self._prefix}".rstrip("/")

    def _bucket(self) -> storage.Bucket:
        # requests sessions are not documented as thread-safe; a client per thread avoids the question.
        bucket = getattr(self._local, "bucket", None)
        if bucket is None:
            client = storage.Client(
                project=os.environ.get("GOOGLE_CLOUD_PROJECT"), credentials=self._credentials()
            )
            bucket = self._local.bucket = client.bucket(self._bucket_name)
        return bucket

    def _credentials(self) -> Any:
        """None with an emulator (the client goes anonymous), else credentials already holding a token:
        missing or unusable ones are one error line here instead of minutes of retries in the first call."""
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            return None
        return google_credentials(field=self.uri, scopes=storage.Client.SCOPE)

    def _blob_name(self, name: str) -> str:
        return self._prefix + name

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        if end is not None and end <= start:
            return b""
        blob = self._bucket().blob(self._blob_name(name), generation=generation)
        whole = start == 0 and end is None
        try:
            return bytes(
                self._retry(blob.download_as_bytes)(
                    start=start or None,
                    end=None if end is None else end - 1,  # the client's end is inclusive
                    raw_download=True,
                    checksum="crc32c" if whole else None,
                    retry=None,
                    timeout=self._timeout_s,
                )
            )
        except api_exceptions.NotFound:
            if generation is None:
                raise self._not_found(name) from None
            current = self._generation_or_none(name)
            raise GenerationChanged(join_uri(self.uri, name), generation, current) from None
        except (api_exceptions.GoogleAPICallError, api_exceptions.RetryError) as error:
            raise self._failed(name, error) from None

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        chunked = len(data) > _ONE_REQUEST_MAX_BYTES and if_generation_match is None
        blob = self._bucket().blob(
            self._blob_name(name), chunk_size=self._upload_chunk_bytes if chunked else None
        )
        # Chunked: the client retries each chunk and resumes (a whole-call retry would start over).
        upload = blob.upload_from_string if chunked else self._retry(blob.upload_from_string)
        try:
            upload(
                data,
                content_type="application/octet-stream",
                if_generation_match=if_generation_match,
                checksum="crc32c",
                retry=self._retry if chunked else None,
                timeout=self._timeout_s,
            )
        except api_exceptions.PreconditionFailed:
            assert if_generation_match is not None
            raise PreconditionFailed(join_uri(self.uri, name), if_generation_match) from None
        except api_exceptions.NotFound:
            raise self._not_found(name) from None
        except (api_exceptions.GoogleAPICallError, api_exceptions.RetryError) as error:
            raise self._failed(name, error) from None
        assert blob.generation is not None
        return int(blob.generation)

    def stat(self, name: str) -> ObjectInfo:
        try:
            blob = self._retry(self._bucket().get_blob)(
                self._blob_name(name), retry=None, timeout=self._timeout_s
            )
        except api_exceptions.NotFound:
            blob = None
        except (api_exceptions.GoogleAPICallError, api_exceptions.RetryError) as error:
            raise self._failed(name, error) from None
        if blob is None:
            raise self._not_found(name)
        return ObjectInfo(
            size_bytes=int(blob.size or 0),
            generation=int(blob.generation or 0),
            crc32c=crc32c_from_base64(blob.crc32c),
        )

    def _generation_or_none(self, name: str) -> int | None:
        try:
            return self.stat(name).generation
        except ObjectNotFound:
            return None

    def exists(self, name: str) -> bool:
        return self._generation_or_none(name) is not None

    def list(self, prefix: str = "") -> list[str]:
        bucket = self._bucket()
        try:

            def list_all() -> list[str]:
                blobs = bucket.client.list_blobs(
                    bucket, prefix=self._blob_name(prefix), retry=None, timeout=self._timeout_s
                )
                return [blob.name.removeprefix(self._prefix) for blob in blobs]

            return sorted(self._retry(list_all)())
        except api_exceptions.NotFound:
            raise ObjectNotFound(f"gs://{self._bucket_name}", "create the bucket or fix the URI") from None
        except (api_exceptions.GoogleAPICallError, api_exceptions.RetryError) as error:
            raise self._failed(prefix, error) from None

    def delete(self, name: str) -> None:
        try:
            self._retry(self._bucket().blob(self._blob_name(name)).delete)(
                retry=None, timeout=self._timeout_s
            )
        except api_exceptions.NotFound:
            raise self._not_found(name) from None
        except (api_exceptions.GoogleAPICallError, api_exceptions.RetryError) as error:
            raise self._failed(name, error) from None

    def _not_found(self, name: str) -> ObjectNotFound:
        if not self._bucket_exists():
            return ObjectNotFound(f"gs://{self._bucket_name}", "create the bucket or fix the URI")
        return ObjectNotFound(join_uri(self.uri, name))

    def _bucket_exists(self) -> bool:
        try:
            self._retry(self._bucket().reload)(retry=None, timeout=self._timeout_s)
        except api_exceptions.NotFound:
            return False
        return True

    def _failed(self, name: str, error: Any) -> StorageError:
        if isinstance(error, api_exceptions.RetryError):
            return StorageError(
                join_uri(self.uri, name),
                f"still failing after retrying: {error.cause}",
                "check that the storage endpoint is reachable and healthy",
            )
        return StorageError(join_uri(self.uri, name), f"request failed: {error.code} {error.message}")
