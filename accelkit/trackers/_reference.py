"""The check a hosted tracker runs on a checkpoint's run reference before continuing that run.

A reference comes from a checkpoint file, so it is untrusted: the run id must look like one,
and the run must belong to the project this tracker logs to now. W&B and Comet share this
check (MLflow also matches its tracking URI and experiment, see ``mlflow.py``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["continuable_id", "short"]


def short(value: Any, limit: int = 80) -> str:
    """A one-line, printable ``repr(value)`` of at most ``limit`` characters.

    For values read from a file (a checkpoint's run reference, a path, a log row), which may
    be huge or crafted: the work is bounded by ``limit``, not by the value (a 5 MB string, a
    100,000-digit integer or a 100,000-deep list cost as little as a short one), and control
    and other unprintable characters are escaped as ``repr`` escapes them (``\\x1b``,
    ``\\n``, ``\\u202e``), so the text cannot move a terminal's cursor or fake a line.

    Args:
        value: any value; JSON values (str, numbers, lists, dicts, ...) are rendered piece by
            piece, other objects by their ``repr`` (a failing one by its type's name).
        limit: the most characters returned; a longer text ends with ``...``.

    Returns:
        The text, ``repr(value)`` itself when that fits.

    Example:
        >>> short("a" * 5_000_000, 12)
        "'aaaaaaaa..."
    """
    pieces: list[str] = []
    _render(value, pieces, limit + 1, 0)
    text = "".join(pieces)
    text = text if text.isprintable() else repr(text)[1:-1]  # an odd repr()
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


_MAX_DEPTH = 20
_MAX_INT_BITS = 10_000  # about 3,000 digits: quick to print, and already far past any limit


def _render(value: Any, out: list[str], budget: int, depth: int) -> int:
    """Append pieces of ``value``'s repr to ``out`` until ``budget`` characters; the rest."""
    if budget <= 0:
        return 0
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:budget])
    elif isinstance(value, bool) or value is None or isinstance(value, float):
        text = repr(value)
    elif isinstance(value, int):
        bits = value.bit_length()
        digits = int(bits * 0.30103)  # log10(2): about right, and never printed in full
        text = repr(value) if bits <= _MAX_INT_BITS else f"<int of about {digits} digits>"
    elif isinstance(value, (list, tuple, dict)):
        if depth >= _MAX_DEPTH:
            text = (
                "[...]"
                if isinstance(value, list)
                else "(...)"
                if isinstance(value, tuple)
                else "{...}"
            )
        else:
            return _render_items(value, out, budget, depth)
    else:
        try:
            text = repr(value)
        except Exception:
            text = f"<{type(value).__name__}>"
    out.append(text[:budget])
    return budget - min(len(text), budget)


def _render_items(
    value: list[Any] | tuple[Any, ...] | dict[Any, Any], out: list[str], budget: int, depth: int
) -> int:
    opening, closing = (
        ("{", "}")
        if isinstance(value, dict)
        else ("(", ")")
        if isinstance(value, tuple)
        else ("[", "]")
    )
    out.append(opening)
    budget -= 1
    items = iter(value.items()) if isinstance(value, dict) else ((None, v) for v in value)
    for index, (key, item) in enumerate(items):
        if budget <= 0:
            return 0
        if index:
            out.append(", ")
            budget -= 2
        if isinstance(value, dict):
            budget = _render(key, out, budget, depth + 1)
            out.append(": ")
            budget -= 2
        budget = _render(item, out, budget, depth + 1)
    if isinstance(value, tuple) and len(value) == 1:
        out.append(",")
        budget -= 1
    out.append(closing)
    return budget - 1


def continuable_id(
    tracker: str,
    reference: Mapping[str, Any],
    *,
    id_key: str,
    id_name: str,
    pattern: re.Pattern[str],
    expected: str,
    project: object,
    own_project: str,
    new: str,
) -> str | None:
    """The run id of ``reference`` if this tracker may continue that run, else ``None`` after
    a warning saying why and that a new run is logged instead.

    Args:
        tracker: the tracker's name, for the warning.
        reference: what the tracker's ``run_reference()`` recorded in the checkpoint.
        id_key: the key of the run id in ``reference`` (``"run_id"``, ``"experiment_key"``).
        id_name: what the id is, for the warning (``"a W&B run id"``).
        pattern: what a run id must match entirely.
        expected: what ``pattern`` accepts, in words, for the warning.
        project: the reference's project as this tracker resolves it.
        own_project: the project this tracker logs to now.
        new: what is logged to instead (``"run"``, ``"experiment"``).
    """
    run_id = reference.get(id_key)
    if not isinstance(run_id, str) or not pattern.fullmatch(run_id):
        _warn(
            tracker,
            f"the checkpoint's {id_key} {short(run_id)} is not {id_name} (expected {expected}); "
            f"logging to a new {new}",
        )
        return None
    if project != own_project:
        _warn(
            tracker,
            f"the checkpoint's {new} {run_id!r} belongs to project {short(project)}, not to "
            f"this run's project {own_project!r}; logging to a new {new} (pass the same "
            "project to init_trackers to continue it)",
        )
        return None
    return run_id


def _warn(tracker: str, what: str) -> None:
    warnings.warn(f"Tracker {tracker!r}: {what}.", UserWarning, stacklevel=4)
