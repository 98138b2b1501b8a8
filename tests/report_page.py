"""Reading a rendered report.html or explore.html as a person does: its visible text, a headline card, a table
row. The report's tests share these."""

from __future__ import annotations

import html
import re


def text_of(page: str) -> str:
    """What a reader sees: the page without its stylesheet, embedded images and tags."""
    page = re.sub(r"<style>.*?</style>|src='data:image/png;base64,[^']*'", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def card(page: str, label: str) -> tuple[str, str]:
    """(value, detail) of the headline card `label`."""
    match = re.search(
        rf"<div class='label'>{re.escape(label)}</div><div class='value'>(.*?)</div><div class='detail'>(.*?)</div>",
        page,
    )
    assert match, f"no headline card {label!r}"
    return html.unescape(match.group(1)), html.unescape(match.group(2))


def row(page: str, first_cells: list[str]) -> list[str]:
    """The cells of the first table row that starts with `first_cells`."""
    for found in re.findall(r"<tr>(.*?)</tr>", page):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", found)]
        if cells[: len(first_cells)] == first_cells:
            return cells
    raise AssertionError(f"no row starting {first_cells}")
