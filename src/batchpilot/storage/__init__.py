"""Storage: objects under a root URI, local folders (`file://`) or GCS (`gs://`), behind one protocol.

- `protocol`: the contract (atomic writes, generations, ranged reads), the errors, `join_uri`;
- `local`: `LocalStorage`, a folder of files;
- `gcs`: `GCSStorage` through google-cloud-storage (imported only for a `gs://` URI).

The data layer, the checkpoints, the run's state files and the reports all go through `open_storage`.
"""

from __future__ import annotations

from pathlib import Path

from batchpilot.errors import BatchpilotError
from batchpilot.storage.local import LocalStorage
from batchpilot.storage.protocol import (
    GenerationChanged,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    join_uri,
)

__all__ = [
    "GenerationChanged",
    "LocalStorage",
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "Storage",
    "StorageError",
    "join_uri",
    "open_storage",
]


def open_storage(uri: str) -> Storage:
    """The storage for a `file://path` (relative or absolute) or `gs://bucket[/prefix]` URI.

    Raises:
        BatchpilotError: for any other scheme or an empty bucket name.
    """
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not path:
            raise BatchpilotError(uri, "names no folder", "use file://relative/path or file:///absolute/path")
        return LocalStorage(Path(path))
    if uri.startswith("gs://"):
        bucket, _, prefix = uri.removeprefix("gs://").partition("/")
        if not bucket:
            raise BatchpilotError(uri, "names no bucket", "use gs://bucket/prefix")
        # Imported here so that local-only installs do not need google-cloud-storage.
        from batchpilot.storage.gcs import GCSStorage

        return GCSStorage(bucket=bucket, prefix=prefix.strip("/"))
    raise BatchpilotError(uri, "is not a storage URI", "use file://path or gs://bucket/prefix")
