"""The report step: report.html and plan.md from the run document and the metrics, and the run folder's
copies; and the report of a failed run from whatever its local run folder holds (`report_failed_run`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot import runstate
from batchpilot.files import write_atomically
from batchpilot.plan.rundoc import RunDocument, read_run_document
from batchpilot.planning.goodput import build_ledger, describe
from batchpilot.storage import open_storage
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
    events = runstate.read_events(document.config.train.checkpoint_uri)
    ledger = build_ledger(events, now_s=time.time())
    if ledger is not None:
        logger.info("%s", describe(ledger))
        keep_launch_records(document.config.train.checkpoint_uri, runstate.launch_records(ledger, events))
    explore_json = explore_dir / "explore.json" if explore_dir is not None else None
    explore_data = json.loads(explore_json.read_text()) if explore_json and explore_json.is_file() else None
    summary = write_report(
        document=document, records=records, explore=explore_data, html_path=html_path,
        markdown_path=markdown_path, explore_html=explore_dir / "explore.html" if explore_dir else None,
        canary=read_canary(document.config), ledger=ledger,
    )  # fmt: skip
    logger.info("report: %s", html_path)
    return summary, records


def report_failed_run(run_dir: Path, *, failure: str) -> Path | None:
    """Writes `run_dir`/report.html for a run that failed, from whatever the run folder holds: plan.json
    (missing when planning failed), explore/explore.json, the canary's canary.json and the metrics (the copy
    beside the plan's `train.checkpoint_uri`, or the trainer's `run_dir`/metrics.jsonl, whichever reached
    further). The page says the run failed, why (`failure`, the run's failure line), where it stopped and
    what ran.

    Returns the report's path; None, after one warning line, when the folder holds nothing to report from
    or the report cannot be written: the run's own failure is the error to show, never this one.
    """
    run_dir = Path(run_dir)
    try:
        return _report_failed_run(run_dir, failure=failure)
    except Exception as error:  # a half-written folder: the run's failure line must stay the last word
        logger.warning("report: no report of the failed run in %s: %s", run_dir, _one_line(error))
        return None


def _report_failed_run(run_dir: Path, *, failure: str) -> Path | None:
    from batchpilot.report import write_report, write_unplanned_report

    document = _run_document(run_dir)
    checkpoint_uri = document.config.train.checkpoint_uri if document else _canary_checkpoint_uri(run_dir)
    explore = _json_file(run_dir / "explore" / "explore.json")
    records = _run_metrics(run_dir, checkpoint_uri)
    canary = _quietly(lambda: runstate.read_canary(checkpoint_uri)) if checkpoint_uri else None
    if document is None and explore is None and not records and canary is None:
        logger.warning(
            "report: %s holds nothing to report the failed run from (no plan.json, explore/explore.json, "
            "metrics or canary.json)", run_dir,
        )  # fmt: skip
        return None
    html_path = run_dir / "report.html"
    explore_html = run_dir / "explore" / "explore.html"
    if document is not None:
        document = _quietly(lambda: current_document(document)) or document
        write_report(
            document=document, records=records, explore=explore, html_path=html_path,
            explore_html=explore_html, canary=canary, failure=failure,
        )  # fmt: skip
    else:
        name = (explore or {}).get("name") or run_dir.name
        write_unplanned_report(
            name=name, records=records, explore=explore, html_path=html_path, failure=failure,
            explore_html=explore_html, canary=canary,
        )  # fmt: skip
    logger.info("report: %s", html_path)
    return html_path


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _quietly(read: Any) -> Any:
    """What `read()` returns, or None when the record is missing, half-written or unreadable."""
    try:
        return read()
    except Exception as error:
        logger.debug("report: skipped a record: %s", _one_line(error))
        return None


def _run_document(run_dir: Path) -> RunDocument | None:
    """The run folder's plan.json, or None when planning did not write one (or it cannot be read)."""
    path = run_dir / "plan.json"
    return _quietly(lambda: read_run_document(path)) if path.is_file() else None


def _json_file(path: Path) -> dict[str, Any] | None:
    data = _quietly(lambda: json.loads(path.read_text())) if path.is_file() else None
    return data if isinstance(data, dict) else None


def _canary_checkpoint_uri(run_dir: Path) -> str | None:
    """Without a plan: the checkpoint URI of the config the canary checked (its spec in the run folder)."""
    spec = _json_file(run_dir / "canary" / "canary-spec.json") or {}
    uri = ((spec.get("config") or {}).get("train") or {}).get("checkpoint_uri")
    return uri if isinstance(uri, str) else None


def _parsed_lines(text: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl text, up to a line the trainer had not finished writing."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            break
        if isinstance(record, dict) and "stage" in record and "consumed_samples" in record:
            records.append(record)
    return records


def _run_metrics(run_dir: Path, checkpoint_uri: str | None) -> list[dict[str, Any]]:
    """The metrics that reached furthest: the copy beside the checkpoints (as of the last checkpoint) or the
    trainer's own metrics.jsonl in the run folder (every step, until the failure)."""
    beside: list[dict[str, Any]] = []
    if checkpoint_uri:
        beside = _quietly(lambda: runstate.load_metrics(checkpoint_uri)) or []
    local_file = run_dir / runstate.METRICS_OBJECT
    local = _parsed_lines(_quietly(local_file.read_text) or "") if local_file.is_file() else []
    return max(beside, local, key=lambda rows: rows[-1]["consumed_samples"] if rows else -1)


def keep_run_record(run_dir: str | Path, document: RunDocument) -> None:
    """Rewrites the run folder's plan.json as the run stands at its end: an adaptive ramp-up's stages and
    decisions (`adaptive_decisions`) as they were taken (any other run's plan is the one planned), and the
    goodput ledger up to now (`goodput`: the report included)."""
    events = runstate.read_events(document.config.train.checkpoint_uri)
    ledger = build_ledger(events, now_s=time.time())
    record = replace(current_document(document), goodput=ledger.to_dict() if ledger is not None else None)
    if ledger is not None:
        keep_launch_records(
            document.config.train.checkpoint_uri, runstate.launch_records(ledger, events), run_dir=run_dir
        )
    write_atomically(Path(run_dir) / "plan.json", record.to_json())


def keep_launch_records(
    checkpoint_uri: str, records: list[dict[str, Any]], run_dir: str | Path | None = None
) -> None:
    """Writes a record per launch (its goodput ledger share, `runstate.launch_records`) into the metrics.jsonl
    kept beside the checkpoints, or into the run folder's (`run_dir`), after the step records: readers of
    step records skip them (`runstate.parse_metrics`), and a resumed trainer drops them (they are written
    again at the next report)."""
    if run_dir is not None:
        path = Path(run_dir) / runstate.METRICS_OBJECT
        if path.is_file():
            write_atomically(path, runstate.with_launch_records(path.read_text(), records))
        return
    storage = open_storage(checkpoint_uri)
    if storage.exists(runstate.METRICS_OBJECT):
        text = storage.read(runstate.METRICS_OBJECT).decode()
        storage.write(runstate.METRICS_OBJECT, runstate.with_launch_records(text, records).encode())


def keep_copies(run_dir: str | Path, files: dict[str, Path]) -> None:
    """Copies step outputs into the local run folder (`batchpilot run --output DIR`)."""
    for name, source in files.items():
        write_atomically(Path(run_dir) / name, source.read_bytes())
