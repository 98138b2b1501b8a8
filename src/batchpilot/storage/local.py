"""Local folders as storage (`file://`): atomic writes, nanosecond generations, per-name locks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from batchpilot.errors import BatchpilotError
from batchpilot.storage.protocol import (
    GenerationChanged,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    join_uri,
)

# Temporary and lock files of LocalStorage start with this; `list` hides them.
_HIDDEN_PREFIX = ".bp-"


class _Writing:
    """An object being written by `LocalStorage.open_write`: its open file, and its generation once written."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.generation = 0


class LocalStorage:
    """A folder of files. Generations are modification times in ns, made strictly increasing per name."""

    def __init__(self, root: Path) -> None:
        self._root = root.absolute()

    @property
    def uri(self) -> str:
        return f"file://{self._root}"

    def _path(self, name: str) -> Path:
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            raise BatchpilotError(join_uri(self.uri, name), "is not a plain relative object name")
        return self._root / name

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        path = self._path(name)
        try:
            with path.open("rb") as file:
                # fstat on the open file: the inode we read is the one whose generation we check, even if
                # a writer replaces the name meanwhile.
                current = os.fstat(file.fileno()).st_mtime_ns
                if generation is not None and current != generation:
                    raise GenerationChanged(join_uri(self.uri, name), generation, current)
                file.seek(start)
                return file.read(-1 if end is None else max(0, end - start))
        except FileNotFoundError:
            if generation is not None:
                raise GenerationChanged(join_uri(self.uri, name), generation, None) from None
            raise ObjectNotFound(join_uri(self.uri, name)) from None

    def write(self, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        with self.open_write(name, if_generation_match=if_generation_match) as writing:
            writing.file.write(data)
        return writing.generation

    @contextlib.contextmanager
    def open_write(
        self, name: str, *, if_generation_match: int | None = None, keep_cached: bool = True
    ) -> Iterator[_Writing]:
        """Writes the object from a stream: `writing.file` takes the bytes, and the object appears whole
        when the block ends without an exception (`writing.generation` is then set) or not at all. A
        checkpoint's shards are serialized straight into the file this way, without a copy in memory.
        `keep_cached=False` drops the file's pages from the page cache once they are on disk: memory that
        the next large write then takes without the kernel reclaiming it first."""
        # Not `files.write_atomically`: between writing the temporary file and renaming it, this fsyncs it,
        # checks the precondition under the name's lock and stamps the generation on it (set after the
        # rename, a reader could pin a generation that then changes under it).
        path = self._path(name)
        tmp = path.with_name(f"{_HIDDEN_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            with _create_in_folder(tmp) as file:
                writing = _Writing(file)
                yield writing
                file.flush()
                os.fsync(file.fileno())
                if not keep_cached:
                    os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            lock = self._name_lock(path) if if_generation_match is not None else contextlib.nullcontext()
            with lock:
                current = self._generation_or_zero(path)
                if if_generation_match is not None and current != if_generation_match:
                    raise PreconditionFailed(join_uri(self.uri, name), if_generation_match)
                # Coarse file-system clocks can give two quick writes the same mtime; the generation must
                # change on every write or a stale precondition could pass.
                writing.generation = max(time.time_ns(), current + 1)
                os.utime(tmp, ns=(writing.generation, writing.generation))
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)

    @staticmethod
    def _lock_path(path: Path) -> Path:
        return path.with_name(f"{_HIDDEN_PREFIX}{path.name}.lock")

    @contextlib.contextmanager
    def _name_lock(self, path: Path, *, make_folder: bool = True) -> Iterator[bool]:
        """Serialises conditional writes and deletes of one name across processes on this machine.

        The holder removes the lock file before it releases it, so no lock file outlives the write or
        delete that made it (also one interrupted by Ctrl-C). A process that was waiting on the removed
        file then holds a lock nobody else can see, so after every `flock` the holder checks that the
        lock path still names the file it locked, and starts over otherwise: only the file at the path
        counts.

        Yields:
            True while holding the lock; False (without locking) when the folder is gone and
            `make_folder` is off (a delete: there is nothing left to delete).
        """
        lock_path = self._lock_path(path)
        while True:
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                if not make_folder:
                    yield False
                    return
                lock_path.parent.mkdir(parents=True, exist_ok=True)  # a delete removed the empty folder
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _names_same_file(lock_path, fd):
                    try:
                        yield True
                    finally:
                        lock_path.unlink(missing_ok=True)  # still ours: unlinked before the flock is released
                    return
            finally:
                os.close(fd)  # closing releases the flock

    @staticmethod
    def _generation_or_zero(path: Path) -> int:
        try:
            return path.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    def stat(self, name: str) -> ObjectInfo:
        try:
            result = self._path(name).stat()
        except FileNotFoundError:
            raise ObjectNotFound(join_uri(self.uri, name)) from None
        return ObjectInfo(size_bytes=result.st_size, generation=result.st_mtime_ns, crc32c=None)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self._root.is_dir():
            return []
        names = []
        for path in self._root.rglob("*"):
            if path.is_file() and not path.name.startswith(_HIDDEN_PREFIX):
                name = path.relative_to(self._root).as_posix()
                if name.startswith(prefix):
                    names.append(name)
        return sorted(names)

    def delete_temporaries(self, folder: str) -> None:
        """Removes the temporary files that writes killed mid-way left in `folder` (only for a folder nobody
        writes to any more, such as a pruned checkpoint's: a running write's temporary would go too)."""
        path = self._path(folder)
        if path.is_dir():
            for leftover in path.rglob(f"{_HIDDEN_PREFIX}*.tmp"):
                leftover.unlink(missing_ok=True)

    def delete(self, name: str) -> None:
        """Deletes the object, its lock file, and the folders this leaves empty.

        The delete holds the name's lock, so it is ordered with conditional writes (`_name_lock` removes
        the lock file before releasing it, and says why that is safe). Folders are removed up to, not
        including, the root; a folder still holding anything (another object, the temporary file of a
        write in progress) stays.
        """
        path = self._path(name)
        if not path.is_file():  # also keeps a delete of a missing name from creating folders
            raise ObjectNotFound(join_uri(self.uri, name))
        with self._name_lock(path, make_folder=False):
            try:
                path.unlink()
            except FileNotFoundError:
                raise ObjectNotFound(join_uri(self.uri, name)) from None
        folder = path.parent
        while folder != self._root and self._root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty, or already gone
                break
            folder = folder.parent


@contextlib.contextmanager
def _create_in_folder(path: Path, *, attempts: int = 5) -> Iterator[BinaryIO]:
    """Opens a new file for writing, creating its folder; tries again when a concurrent `delete` removed
    the (empty) folder between the two."""
    for attempt in range(attempts):
        try:
            # mkdir(exist_ok=True) raises FileExistsError when the folder it found existing is removed
            # before it checks that it is a folder.
            path.parent.mkdir(parents=True, exist_ok=True)
            file = path.open("xb")
        except (FileNotFoundError, FileExistsError) as error:
            if attempt == attempts - 1 or (isinstance(error, FileExistsError) and path.exists()):
                raise
            continue
        with file:
            yield file
        return


def _names_same_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the open file `fd` (a delete may have unlinked it)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _fsync_dir(path: Path) -> None:
    """Makes a rename durable: the directory entry must reach the disk too."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # a concurrent delete removed the object and its folder: nothing to sync
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
