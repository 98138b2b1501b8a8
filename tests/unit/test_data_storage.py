"""Local storage: the atomic-write and generation contract that checkpoints and shards rely on."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.storage import (
    GenerationChanged,
    LocalStorage,
    ObjectNotFound,
    PreconditionFailed,
    open_storage,
)


@pytest.fixture
def store(tmp_path: Path) -> LocalStorage:
    storage = open_storage(f"file://{tmp_path}/root")
    assert isinstance(storage, LocalStorage)
    return storage


def test_write_read_ranges_and_stat(store: LocalStorage) -> None:
    generation = store.write("a/b.bin", b"0123456789")
    assert store.read("a/b.bin") == b"0123456789"
    assert store.read("a/b.bin", start=2, end=5) == b"234"
    assert store.read("a/b.bin", start=7) == b"789"
    info = store.stat("a/b.bin")
    assert (info.size_bytes, info.generation) == (10, generation)
    assert store.exists("a/b.bin") and not store.exists("a/c.bin")
    assert store.list() == ["a/b.bin"] and store.list("a/") == ["a/b.bin"] and store.list("b") == []


def test_generation_changes_on_every_write_and_preconditions_hold(store: LocalStorage) -> None:
    first = store.write("latest", b"1", if_generation_match=0)
    with pytest.raises(PreconditionFailed, match="latest"):
        store.write("latest", b"x", if_generation_match=0)
    generations = [first]
    for value in range(20):  # quicker than a coarse file-system clock tick
        generations.append(store.write("latest", str(value).encode(), if_generation_match=generations[-1]))
    assert generations == sorted(set(generations))
    with pytest.raises(PreconditionFailed):
        store.write("latest", b"stale", if_generation_match=first)
    assert store.read("latest") == b"19"


def test_only_one_of_racing_conditional_writers_wins(store: LocalStorage) -> None:
    base = store.write("latest", b"base")
    wins: list[int] = []

    def attempt(index: int) -> None:
        try:
            store.write("latest", f"writer {index}".encode(), if_generation_match=base)
            wins.append(index)
        except PreconditionFailed:
            pass

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1
    assert store.read("latest") == f"writer {wins[0]}".encode()


def test_readers_never_see_a_partial_object(store: LocalStorage) -> None:
    versions = [bytes([v]) * 2_000_000 for v in range(2)]
    store.write("big", versions[0])
    seen: set[bytes] = set()
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            data = store.read("big")
            seen.add(data[:1] if data in versions else b"partial")

    reader = threading.Thread(target=read_loop)
    reader.start()
    for index in range(20):
        store.write("big", versions[index % 2])
    stop.set()
    reader.join()
    assert b"partial" not in seen
    assert store.list() == ["big"]  # no temporary or lock files listed


def test_pinned_read_after_overwrite_is_an_error(store: LocalStorage) -> None:
    generation = store.write("shard.bin", b"old")
    store.write("shard.bin", b"new")
    with pytest.raises(GenerationChanged, match=r"shard.bin: changed after it was opened"):
        store.read("shard.bin", generation=generation)
    store.delete("shard.bin")
    with pytest.raises(GenerationChanged, match="deleted"):
        store.read("shard.bin", generation=generation)


def test_missing_objects_are_named(store: LocalStorage) -> None:
    with pytest.raises(ObjectNotFound, match=r"root/nope.bin: does not exist"):
        store.stat("nope.bin")
    with pytest.raises(ObjectNotFound, match=r"nope\.bin"):
        store.read("nope.bin")
    with pytest.raises(ObjectNotFound):
        store.delete("nope.bin")
    assert store.list() == []


def test_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = open_storage("file://runs/demo/data")
    relative.write("x", b"1")
    assert (tmp_path / "runs/demo/data/x").read_bytes() == b"1"
    assert relative.uri == f"file://{tmp_path}/runs/demo/data"
    for bad in ("s3://bucket/x", "file://", "gs://"):
        with pytest.raises(BatchpilotError):
            open_storage(bad)
    with pytest.raises(BatchpilotError, match="relative object name"):
        relative.read("../escape")


def test_delete_removes_the_folders_it_empties_and_the_lock_file(store: LocalStorage, tmp_path: Path) -> None:
    root = tmp_path / "root"
    store.write("000000010/model.pt", b"m")
    store.write("000000010/meta.json", b"{}", if_generation_match=0)
    assert sorted(p.name for p in (root / "000000010").iterdir()) == ["meta.json", "model.pt"]  # no lock file
    store.write("000000020/deep/x.bin", b"x")
    store.write("latest", b"000000020", if_generation_match=0)
    store.delete("000000010/model.pt")
    assert (root / "000000010").is_dir()  # meta.json is still there
    store.delete("000000010/meta.json")
    assert not (root / "000000010").exists()  # no empty step folder, no lock file keeping it alive
    store.delete("000000020/deep/x.bin")
    assert sorted(p.name for p in root.iterdir()) == ["latest"]
    store.delete("latest")
    assert root.is_dir() and list(root.iterdir()) == []  # the root itself stays
    store.write("000000010/meta.json", b"again", if_generation_match=0)  # and folders come back
    assert store.read("000000010/meta.json") == b"again"


def test_conditional_writers_stay_exclusive_while_deletes_remove_lock_files(store: LocalStorage) -> None:
    # Each thread tries to create the object (only if absent); the one that did reads its own bytes back
    # and deletes it, which removes the lock file and the folder. A second creator in between (a writer
    # that waited on a removed lock file, next to one holding the new one) shows up as someone else's
    # bytes or as a delete of an object that is already gone.
    errors: list[str] = []
    creations = [0]

    def attempt(index: int) -> None:
        try:
            attempts(index)
        except Exception as error:  # a thread's exception would otherwise be only a pytest warning
            errors.append(f"writer {index} failed: {error!r}")

    def attempts(index: int) -> None:
        mine = f"writer {index}".encode()
        for _ in range(150):
            try:
                store.write("step/latest", mine, if_generation_match=0)
            except PreconditionFailed:
                continue
            creations[0] += 1
            try:
                if (seen := store.read("step/latest")) != mine:
                    errors.append(f"{mine!r} created the object but it holds {seen!r}")
                store.delete("step/latest")
            except ObjectNotFound as error:
                errors.append(f"{mine!r} created the object, then: {error}")

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and creations[0] > 50
    assert store.list() == [] and not (Path(store.uri.removeprefix("file://")) / "step").exists()


def open_flags(fd: int) -> int:
    """The open file's flags as the kernel holds them (/proc/self/fdinfo's `flags`, octal)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines())
    return int(fields["flags"].strip(), 8)


def takes_direct_writes(folder: Path) -> bool:
    probe = folder / "direct-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, (8 << 20) - 1, (8 << 20) + 4097, 3 * (8 << 20)])
def test_a_write_past_the_page_cache_gives_the_same_object_at_any_length(tmp_path: Path, size: int) -> None:
    """`open_write(keep_cached=False)` (a checkpoint's shards) writes with O_DIRECT where the file system takes
    it: the bytes gathered in an aligned buffer, the last piece padded and the file cut back to its length;
    the object is byte for byte what was written, in pieces of any size."""
    if not takes_direct_writes(tmp_path):
        pytest.skip(f"{tmp_path}'s file system takes no direct writes")
    store = LocalStorage(tmp_path / "root")
    data = os.urandom(size)
    with store.open_write("ckpt/shard.distcp", keep_cached=False) as writing:
        assert open_flags(writing.file.fileno()) & os.O_DIRECT
        for start in range(0, size, 1_000_003):  # pieces that fall across the buffer's edges
            writing.file.write(memoryview(data)[start : start + 1_000_003])
    assert writing.generation > 0
    assert (tmp_path / "root" / "ckpt" / "shard.distcp").read_bytes() == data
    assert [p.name for p in (tmp_path / "root" / "ckpt").iterdir()] == ["shard.distcp"]  # no temporary left


def test_a_write_past_the_page_cache_on_a_file_system_without_direct_writes_goes_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without direct writes (tmpfs before Linux 6.6) fails the open with EINVAL after creating
    the file: the object is written the ordinary way, whole, and nothing else is left."""
    real_open = os.open

    def without_direct(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))  # created, as the kernel leaves it
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", without_direct)
    store = LocalStorage(tmp_path / "root")
    data = os.urandom(10_000)
    with store.open_write("ckpt/shard.distcp", keep_cached=False) as writing:
        assert not open_flags(writing.file.fileno()) & os.O_DIRECT
        writing.file.write(data)
    assert (tmp_path / "root" / "ckpt" / "shard.distcp").read_bytes() == data
    assert [p.name for p in (tmp_path / "root" / "ckpt").iterdir()] == ["shard.distcp"]
