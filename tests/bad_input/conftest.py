"""Fixtures the bad-input suite shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import closed_port


@pytest.fixture
def no_google_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No Application Default Credentials anywhere: no key file, an empty gcloud folder, no metadata server
    (google-auth's check skipped, and its address a closed loopback port)."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "gcloud").mkdir()
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # google-auth reads exactly "true"
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed_port()}")
    (tmp_path / "doc.txt").write_text("a document\n" * 20)
    yield tmp_path
