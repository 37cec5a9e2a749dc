"""Showing untrusted text: the one escape that every message and table of accelkit goes through.

A checkpoint, a manifest, a tracker's run reference or a file name may hold bytes chosen by an
attacker: ``ESC ] 0 ;`` retitles the terminal, ``ESC [ 2 J`` clears it, ``ESC [ 8 m`` hides the
text after it (a ``corrupt`` state, say), ``U+202E`` reverses what follows, ``\\r`` overwrites
the line, a lone surrogate from a non-UTF-8 file name makes ``print`` raise. Before such text
reaches a terminal or a log, every character that Python does not call printable
(:meth:`str.isprintable`: the C0 and C1 controls, DEL, format characters such as the bidi
overrides and zero-width joiners, line and paragraph separators, spaces other than ``" "``,
surrogates, private-use and unassigned code points) is written as the escape ``repr`` uses:
``\\n``, ``\\x1b``, ``\\u202e``, ``\\U000e0001``.

Backslashes are left as they are, so text that is already escaped (a ``{path!r}`` inside an
error message) is shown unchanged: :func:`escape` is idempotent and can be applied both where
a value is formatted and again where the whole message is printed. The price is that a name
holding a literal backslash sequence reads like an escaped one; the characters that could act
on a terminal never pass.

Public API: :func:`escape`, :func:`short` (its work depends on ``limit``, not on the value),
:func:`clip` (a message escaped and cut to a bounded length, its start and end kept),
:func:`at_most` (the first items of a list that may be huge, and how many were left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["at_most", "clip", "escape", "short"]


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str) -> str:
    """``text`` with every non-printable character written as a ``\\x1b``-style escape.

    Args:
        text: anything that may come from a checkpoint, a file name or a run reference.

    Returns:
        ``text`` itself when it is printable (the common case costs one scan), else a copy in
        which no character can move the cursor, change the terminal or hide what follows.

    Example:
        >>> escape("loss\\x1b]0;pwned\\x07")
        'loss\\\\x1b]0;pwned\\\\x07'
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


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
    text = escape(text)  # a custom __repr__ need not escape
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def clip(text: str, limit: int = 4000) -> str:
    """``text`` escaped (:func:`escape`) and, when longer than ``limit``, cut in the middle.

    For whole messages that quote untrusted values (an error naming every file a crafted
    manifest lists, a warning quoting a checkpoint's problems): the start says what is wrong
    and the end says what to do, so both are kept and the middle gives way, with a note of how
    much was left out. Idempotent for texts within ``limit``, like :func:`escape`.

    Args:
        text: the message.
        limit: the most characters returned (at least 200).

    Returns:
        A printable, one-line text of at most ``limit`` characters.

    Example:
        >>> len(clip("missing: " + "x; " * 1_000_000, 300)) <= 300
        True
    """
    limit = max(limit, 200)
    # Escaping makes a character at most 10 long; escaping only the ends keeps the work bounded.
    head = escape(text[:limit])
    if len(text) <= limit and len(head) <= limit:
        return head
    note = f" [... cut: {len(text):,} characters in all ...] "
    room = limit - len(note)
    tail = escape(text[-limit:])[-(room // 4) :]
    return head[: room - len(tail)] + note + tail


def at_most(items: Sequence[str], limit: int) -> list[str]:
    """The first ``limit`` of ``items``, and a last one saying how many more there are.

    For lists read from a file (the problems of a checkpoint whose crafted manifest lists
    200,000 missing files): what is shown stays a few lines, and says that it is not all.

    Example:
        >>> at_most(["a", "b", "c"], 2)
        ['a', 'b', '... and 1 more']
    """
    if len(items) <= limit:
        return list(items)
    return [*items[:limit], f"... and {len(items) - limit:,} more"]


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
