"""One look for batchpilot's HTML pages (report.html, explore.html): the stylesheet, the page frame, tables
and figures. Every page is one self-contained file: no script, no font or image fetched from elsewhere
(the KFP UI shows an HTML artifact in a sandboxed frame, often without network access)."""

from __future__ import annotations

import html
from collections.abc import Sequence

STYLESHEET = """
:root{--ink:#1f2328;--muted:#59636e;--line:#d1d9e0;--soft:#f6f8fa;--accent:#0969da;--warn:#9a6700;--warnbg:#fff8c5}
*{box-sizing:border-box}
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--ink);
max-width:1360px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:20px;margin:36px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:16px;margin:20px 0 8px}
p,li{max-width:1100px}.muted{color:var(--muted)}
table{border-collapse:collapse;margin:8px 0 12px;font-variant-numeric:tabular-nums;display:block;max-width:100%;
overflow-x:auto}
th,td{border:1px solid var(--line);padding:4px 10px;vertical-align:top;white-space:nowrap}
th{background:var(--soft);font-weight:600;text-align:left}
tr:nth-child(even) td{background:#fbfcfd}
td.r,th.r{text-align:right}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));gap:10px;margin:16px 0}
.card.wide{grid-column:span 2}
.card{border:1px solid var(--line);border-radius:8px;padding:10px 14px;background:#fff}
.card .label{color:var(--muted);font-size:13px}.card .value{font-size:22px;font-weight:600}
.card .detail{color:var(--muted);font-size:13px}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(640px,1fr));gap:16px}
figure{margin:0;border:1px solid var(--line);border-radius:8px;padding:8px}
figure img{max-width:100%;height:auto;display:block}figcaption{font-weight:600;margin-bottom:4px}
.warn{background:var(--warnbg);border:1px solid #d4a72c;border-radius:6px;padding:8px 12px;color:#3b2e00}
.mark{display:inline-block;border-radius:10px;padding:0 7px;font-size:12px;margin-right:4px;background:var(--soft);
border:1px solid var(--line)}
.mark.rec{background:#ddf4ff;border-color:#54aeff}.mark.trained{background:#dafbe1;border-color:#4ac26b}
.mark.repeat{background:#f6f8fa}
.status{margin:0 0 8px}.state{display:inline-block;border-radius:10px;padding:0 9px;font-weight:600;
border:1px solid var(--line)}
.state.completed{background:#dafbe1;border-color:#4ac26b}.state.failed{background:#ffebe9;border-color:#ff8182}
code{background:var(--soft);padding:1px 4px;border-radius:4px}
"""


class Html(str):
    """Text that is already HTML: `table` puts it in a cell as it is (any other cell text is escaped)."""


def cell(value: str) -> str:
    """`value` as cell HTML: escaped unless it is `Html`."""
    return value if isinstance(value, Html) else html.escape(value)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, align: str = "") -> Html:
    """An HTML table; `align` holds one letter per column, `l` or `r` (numbers), `l` where it is short."""
    classes = [" class='r'" if align[i : i + 1] == "r" else "" for i in range(len(header))]
    head = "".join(f"<th{c}>{html.escape(h)}</th>" for c, h in zip(classes, header, strict=True))
    body = "".join(
        "<tr>" + "".join(f"<td{c}>{cell(v)}</td>" for c, v in zip(classes, row, strict=True)) + "</tr>"
        for row in rows
    )
    return Html(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def bullets(lines: Sequence[str]) -> Html:
    return Html("<ul>" + "".join(f"<li>{cell(line)}</li>" for line in lines) + "</ul>")


def figure(title: str, png_base64: str) -> Html:
    """A titled PNG, embedded."""
    escaped = html.escape(title)
    return Html(
        f"<figure><figcaption>{escaped}</figcaption><img alt='{escaped}' src='data:image/png;base64,{png_base64}'>"
        "</figure>"
    )


def page(title: str, body: str) -> str:
    """The whole document around `body`."""
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{STYLESHEET}</style></head><body>{body}</body></html>\n"
    )
