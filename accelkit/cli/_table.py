"""Plain-text tables and human-readable sizes and ages for the ``accelkit`` command."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["format_age", "format_size", "render_table"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_size(num_bytes: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (powers of 1024; ``"-"`` for ``None``).

    Example:
        >>> format_size(3 * 1024**2)
        '3.0 MiB'
    """
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_age(seconds: float | None) -> str:
    """``7380`` -> ``"2h"``: the largest whole unit (s, m, h, d); ``"-"`` when unknown.

    A negative age (a clock ahead of this machine's) reads ``"0s"``.
    """
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, seconds)
    for limit, unit, div in ((60, "s", 1), (3600, "m", 60), (86400, "h", 3600)):
        if seconds < limit:
            return f"{int(seconds // div)}{unit}"
    return f"{int(seconds // 86400)}d"


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[str] = ()
) -> str:
    """Columns separated by two spaces, padded to the widest cell; no trailing spaces.

    Args:
        headers: column titles.
        rows: cells, already formatted as strings.
        right: titles of the columns to right-align (numbers).
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    right_set = set(right)
    lines = []
    for row in [list(headers), *[list(r) for r in rows]]:
        cells = [
            cell.rjust(widths[i]) if headers[i] in right_set else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
