"""Human-friendly counts: `10M` samples, `5Bt` tokens, `2GiB` bytes."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from batchpilot.errors import BatchpilotError

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_BYTES_SUFFIX = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([KMBT]?)\s*$", re.IGNORECASE)
_BYTES_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def _exact_int(number: Fraction, *, field: str, text: str) -> int:
    if number.denominator != 1:
        raise BatchpilotError(field, f"{text!r} is not a whole number", "give a whole count")
    return int(number)


def parse_count(value: int | str, *, field: str) -> int:
    """Parses a non-negative count such as `4096`, `10_000`, `2K`, `10M` or `1.5B` (decimal suffixes).

    Raises:
        BatchpilotError: if the text is not a whole non-negative count.
    """
    if isinstance(value, bool):
        raise BatchpilotError(field, f"expected a count, got {value!r}", "write a number such as 4096 or 10M")
    if isinstance(value, int):
        if value < 0:
            raise BatchpilotError(field, f"must not be negative, got {value}")
        return value
    match = _COUNT_RE.match(str(value))
    if not match:
        raise BatchpilotError(
            field,
            f"{value!r} is not a count",
            "write a number with an optional K, M, B or T suffix, e.g. 10M",
        )
    number = Fraction(match.group(1).replace("_", "")) * _COUNT_SUFFIX[match.group(2).upper()]
    return _exact_int(number, field=field, text=str(value))


def parse_threshold(text: str, *, field: str) -> tuple[int, bool]:
    """Parses a schedule threshold: a count in samples, or in tokens with a trailing `t` (`5Bt`).

    Returns:
        (value, is_tokens).
    """
    stripped = text.strip()
    is_tokens = stripped.endswith("t")
    if is_tokens:
        stripped = stripped[:-1]
    return parse_count(stripped, field=field), is_tokens


def parse_bytes(value: int | str, *, field: str) -> int:
    """Parses a byte size such as `2147483648`, `2GiB`, `512MiB` or `2GB`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise BatchpilotError(field, f"must be positive, got {value}")
        return value
    match = _BYTES_RE.match(str(value))
    if not match or match.group(2).upper() not in _BYTES_SUFFIX:
        raise BatchpilotError(field, f"{value!r} is not a byte size", "write e.g. 2GiB, 512MiB or 2000000000")
    number = Fraction(match.group(1).replace("_", "")) * _BYTES_SUFFIX[match.group(2).upper()]
    result = _exact_int(number, field=field, text=str(value))
    if result <= 0:
        raise BatchpilotError(field, f"must be positive, got {value!r}")
    return result


def format_count(value: int) -> str:
    """Formats a count compactly and exactly: 10000000 -> `10M`, 1428736 -> `1,428,736`."""
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{suffix}"
    return f"{value:,}"


def short_count(value: int) -> str:
    """An approximate count for tables: 1428736 -> `1.43M`, 4096 -> `4,096`."""
    for suffix, scale in (("B", 10**9), ("M", 10**6)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:,}"


def format_bytes(value: float) -> str:
    """`46.7 GiB`, or `312.5 MiB` below a GiB (memory estimates and budgets)."""
    if value >= 2**30:
        return f"{value / 2**30:,.1f} GiB"
    return f"{value / 2**20:,.1f} MiB"


# --- numbers for people: reports, plan.md and the CLI's tables ------------------------------------


def format_int(value: float) -> str:
    """A whole number with thousands separators: 16384 -> `16,384`."""
    return f"{round(value):,}"


def format_number(value: float, *, digits: int = 3) -> str:
    """A measured quantity to `digits` significant digits, never in exponent form and never `0` for a
    small positive value, without trailing zeros: 2.173165 -> `2.17`, 0.3206 -> `0.321`, 0.000733 -> `0.000733`,
    0.030 -> `0.03`, 95560.7 -> `95,561`."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    magnitude = math.floor(math.log10(abs(value)))
    text = f"{value:,.{max(0, digits - 1 - magnitude)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_ratio(value: float) -> str:
    """A speed-up or a throughput ratio: 2.173165 -> `2.17x`."""
    return f"{value:.2f}x"


def format_duration(seconds: float) -> str:
    """A duration in the unit a person reads it in: `0.4 s`, `45 s`, `1.2 min`, `3.4 h`, `2.5 days`."""
    if round(seconds) < 60:
        return f"{format_number(seconds, digits=2)} s"
    if round(seconds / 60, 1) < 60:
        return f"{seconds / 60:.1f} min"
    if round(seconds / 3600, 1) < 48:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def format_node_hours(node_hours: float) -> str:
    """Node-hours to two significant digits, so that a short run reads `0.0087`, not `0.00`."""
    return format_number(node_hours, digits=2)


def format_loss(loss: float) -> str:
    """A loss to three decimals, as the training log prints it (losses are compared across stages by eye)."""
    return f"{loss:.3f}"
