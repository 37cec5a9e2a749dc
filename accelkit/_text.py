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

Public API: :func:`escape`, :func:`short`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["escape", "short"]


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
    """``repr(value)``, cut to ``limit`` characters (values from a file may be huge).

    The result is safe to print: ``repr`` of a string escapes what :func:`escape` does.
    """
    text = escape(repr(value))  # a custom __repr__ need not escape
    return text if len(text) <= limit else text[: limit - 3] + "..."
