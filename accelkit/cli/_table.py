"""Plain-text tables and human-readable sizes and ages for the ``accelkit`` command."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from accelkit._text import escape

__all__ = ["format_age", "format_runs", "format_size", "one_entry", "render_table"]

# The keys holding a run's id in the trackers' run references (MLflow and W&B, Comet; an
# MLflow run named by its run key before it opened).
_RUN_ID_KEYS = ("run_id", "experiment_key", "run_key")
# What would split the RUNS cell into several entries or columns, after escaping.
_SEPARATORS = re.compile(r"[\s,:]")

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


def format_runs(experiment: Mapping[str, Any] | None) -> str:
    """A manifest's ``experiment`` record as ``mlflow:1a2b3c4d,tensorboard`` (``"-"``: none).

    One entry per tracker, by name: ``name:<first 8 characters of the run id>`` for trackers
    whose reference has an id (``run_id``, ``experiment_key``, else ``run_key``), the name
    alone for the others
    (folder-based ones). A manifest is untrusted: control characters are escaped as
    everywhere else (:func:`accelkit._text.escape`), and spaces, ``,`` and ``:`` are shown as
    ``?`` so that the cell stays one entry per tracker in one column.

    Example:
        >>> format_runs({"step": 9, "runs": {"mlflow": {"run_id": "0123456789abcdef"}}})
        'mlflow:01234567'
    """
    runs = (experiment or {}).get("runs") or {}
    entries = []
    names = sorted(runs)
    for name in names[:_MAX_RUNS]:
        reference = runs[name]
        ids = [reference.get(key) for key in _RUN_ID_KEYS] if isinstance(reference, Mapping) else []
        run_id = next((value for value in ids if isinstance(value, str) and value), None)
        label = _one_entry(str(name)[:40])
        entries.append(label if run_id is None else f"{label}:{_one_entry(run_id[:8])}")
    if len(names) > _MAX_RUNS:  # a crafted record may name 200,000 trackers: one cell
        entries.append(f"+{len(names) - _MAX_RUNS}")
    return ",".join(entries) or "-"


_MAX_RUNS = 8


def _one_entry(text: str) -> str:
    return _SEPARATORS.sub("?", escape(text))


def one_entry(text: str, separators: str) -> str:
    """``text`` escaped, with whitespace and each of ``separators`` shown as ``?``.

    For a name inside a table cell that holds several ``name=value`` entries: a name holding
    ``" "`` or ``"="`` could otherwise fake another entry (``"acc=0.99 loss"`` shown as
    ``acc=0.99 loss=5``).

    Example:
        >>> one_entry("acc=0.99 loss", "=")
        'acc?0.99?loss'
    """
    escaped = escape(text)
    return "".join("?" if c.isspace() or c in separators else c for c in escaped)


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[str] = ()
) -> str:
    """Columns separated by two spaces, padded to the widest cell; no trailing spaces.

    Every cell is escaped (:func:`accelkit._text.escape`): cells hold names from untrusted
    checkpoints, and a control character in one must neither act on the terminal nor break
    the row in two.

    Args:
        headers: column titles.
        rows: cells, already formatted as strings.
        right: titles of the columns to right-align (numbers).
    """
    headers = [escape(h) for h in headers]
    rows = [[escape(cell) for cell in row] for row in rows]
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
