"""The report step: report.html and plan.md from the run document and the metrics, and the run folder's
copies."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot import runstate
from batchpilot.files import write_atomically
from batchpilot.plan.rundoc import RunDocument
from batchpilot.workflow.canary import read_canary
from batchpilot.workflow.document import current_document

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def report(
    document: RunDocument, *, explore_dir: Path | None, html_path: Path, markdown_path: Path
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Writes the run report (HTML + Markdown plan table); returns its headline numbers and the records."""
    from batchpilot.report import write_report

    document = current_document(document)  # an adaptive ramp-up's stages as the run decided them
    records = runstate.load_metrics(document.config.train.checkpoint_uri)
    explore_json = explore_dir / "explore.json" if explore_dir is not None else None
    explore_data = json.loads(explore_json.read_text()) if explore_json and explore_json.is_file() else None
    summary = write_report(
        document=document, records=records, explore=explore_data, html_path=html_path,
        markdown_path=markdown_path, explore_html=explore_dir / "explore.html" if explore_dir else None,
        canary=read_canary(document.config),
    )  # fmt: skip
    logger.info("report: %s", html_path)
    return summary, records


def keep_run_record(run_dir: str | Path, document: RunDocument) -> None:
    """Rewrites the run folder's plan.json as the run stands at its end: an adaptive ramp-up's stages and
    decisions (`adaptive_decisions`) as they were taken; any other run's plan is the one planned."""
    write_atomically(Path(run_dir) / "plan.json", current_document(document).to_json())


def keep_copies(run_dir: str | Path, files: dict[str, Path]) -> None:
    """Copies step outputs into the local run folder (`batchpilot run --output DIR`)."""
    for name, source in files.items():
        write_atomically(Path(run_dir) / name, source.read_bytes())
