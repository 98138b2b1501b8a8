"""The run report in a real browser: headless Chromium (Debian's `chromium` package) opens report.html as a
practitioner would, at 1400 px, and takes a screenshot; any console message is a page error (the report has no
script of its own, so one can only come from a broken page)."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from batchpilot.report import write_report
from report_samples import sample_document, sample_explore, sample_records

CHROMIUM = Path("/usr/bin/chromium")
WIDTH_PX = 1400

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="/usr/bin/chromium is absent (apt-get install chromium to run this test)"
)


def screenshot(page: Path, png: Path, profile: Path) -> list[str]:
    """Opens `page` headless, writes `png`; returns the console lines Chromium logged."""
    result = subprocess.run(
        [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
            f"--window-size={WIDTH_PX},3000", f"--screenshot={png}", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def png_size(png: Path) -> tuple[int, int]:
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_the_report_opens_in_chromium_without_a_page_error(tmp_path):
    document = sample_document()
    page = tmp_path / "report.html"
    write_report(
        document=document, records=sample_records(document), explore=sample_explore(), html_path=page
    )
    png = tmp_path / "report.png"
    console = screenshot(page, png, tmp_path / "profile")
    assert console == []
    assert png_size(png) == (WIDTH_PX, 3000)
    assert png.stat().st_size > 100_000  # the headline, tables and plots drawn, not a blank page


def test_a_failed_runs_report_opens_in_chromium_without_a_page_error(tmp_path):
    document = sample_document()
    page = tmp_path / "report.html"
    write_report(
        document=document, records=sample_records(document)[:100], explore=sample_explore(), html_path=page,
        failure="the pipeline failed in task train-stage-1",
    )  # fmt: skip
    png = tmp_path / "report.png"
    assert screenshot(page, png, tmp_path / "profile") == []
    assert png.stat().st_size > 100_000


def test_a_page_error_is_caught(tmp_path):
    """The check above can fail: a script error on the page shows as a console line."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!doctype html><html><body><script>throw new Error('broken report')</script></body></html>"
    )
    console = screenshot(page, tmp_path / "broken.png", tmp_path / "profile")
    assert len(console) == 1 and "broken report" in console[0]
