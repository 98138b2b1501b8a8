"""Local files written atomically: a reader sees the old content or the new, never a partial file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: the process's umask, for the mode a plain open() would give


def write_atomically(path: str | Path, data: str | bytes) -> Path:
    """Writes `data` to `path` through a temporary file in the same folder and an atomic rename.

    The folder is created when missing; the file gets the mode a plain `open(path, "w")` would give it
    (mkstemp's own is 0600). Returns the path written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
