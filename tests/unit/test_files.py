"""write_atomically: whole files only, the usual permissions, nothing left behind."""

import os

import pytest

from batchpilot.files import write_atomically


def test_writes_text_or_bytes_into_a_new_folder_with_a_plain_files_mode(tmp_path):
    path = write_atomically(tmp_path / "a" / "plan.json", "{}\n")
    assert path.read_text() == "{}\n"
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    write_atomically(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = write_atomically(tmp_path / "report.html", "old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
