"""Local files written atomically (a reader sees the old content or the new, never a partial file), and the
checks every command runs on its output path before any work, so that a path it cannot write to is one
line at the start instead of a traceback at the end."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from batchpilot.errors import BatchpilotError

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


def check_output_file(path: str | Path, *, field: str, force: bool = False) -> Path:
    """Refuses an output file path that a command could not write, before it does any work.

    Refused: an existing folder; an existing file unless `force`; a path below a file; a folder that is
    not writable. Missing folders are fine (`write_atomically` creates them).

    Args:
        path: the file the command will write.
        field: the option that names it, e.g. `--out`, for the error line.
        force: whether an existing file may be replaced.

    Returns:
        The path.
    """
    target = Path(path)
    if target.is_dir():
        raise BatchpilotError(field, f"{path} is a folder", f"give a file path, e.g. {target / 'NAME'}")
    if target.exists() and not force:
        raise BatchpilotError(field, f"{path} exists", "choose another path or pass --force")
    _check_creatable(target.parent, path=path, field=field)
    return target


def check_output_dir(path: str | Path, *, field: str) -> Path:
    """Refuses an output folder that a command could not write into, before it does any work.

    Refused: an existing file; a path below a file; a folder (itself, or the nearest existing one above
    it) that is not writable. Whether a used folder may be written into again is the command's own rule.

    Returns:
        The path.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise BatchpilotError(
            field, f"{path} is a file, not a folder", "give a folder path (a missing folder is created)"
        )
    _check_creatable(target, path=path, field=field)
    return target


def _check_creatable(folder: Path, *, path: str | Path, field: str) -> None:
    """`folder` exists and is writable, or its nearest existing ancestor is a writable folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BatchpilotError(
            field, f"{path} cannot be created: {existing} is a file", "give a path whose folders are folders"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BatchpilotError(
            field, f"cannot write to {path}: {existing} is not writable", "choose a folder you can write to"
        )
