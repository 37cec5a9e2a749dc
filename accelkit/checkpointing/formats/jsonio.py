"""The one reader of JSON that comes from a checkpoint (untrusted input).

Every JSON file of a checkpoint (the manifest, state files, model indexes, safetensors headers
go through their own parser but use the same rules) is read with :func:`load_json`, so a
hostile file fails the same way everywhere: a :class:`~accelkit.checkpointing.errors.
CorruptCheckpointError` naming the file, never a bare ``RecursionError`` or ``OverflowError``
from a later step. Refused:

- anything that is not JSON (bad UTF-8, syntax);
- nesting deeper than :data:`MAX_DEPTH` (accelkit's own files nest a few levels; a deep
  document would crash every recursive consumer after the parser);
- numbers that do not fit a double (``1e999999``) and the non-standard ``NaN``/``Infinity``
  literals; integers longer than Python's digit limit.

Memory stays a small multiple of the file's size (the parsed objects).

Public API: :data:`MAX_DEPTH`, :func:`load_json`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from accelkit.checkpointing.errors import CorruptCheckpointError

__all__ = ["MAX_DEPTH", "load_json"]

MAX_DEPTH = 100


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]!r} does not fit a 64-bit float")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def load_json(raw: bytes | str, source: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``raw`` read from ``source`` with the rules of the module docstring.

    Args:
        raw: the file's contents.
        source: the file's path or URL, for messages.
        max_depth: deepest nesting of objects and arrays allowed.

    Raises:
        CorruptCheckpointError: naming ``source`` and what is wrong.
    """
    try:
        value = json.loads(raw, parse_float=_finite, parse_constant=_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise CorruptCheckpointError(
            f"{source}: not valid JSON ({why}). The file is damaged or crafted: load another "
            "checkpoint."
        ) from None
    if isinstance(value, (dict, list)) and _too_deep(value, max_depth):
        raise CorruptCheckpointError(
            f"{source}: JSON nested deeper than {max_depth} levels; accelkit's files are far "
            "shallower, so it is damaged or crafted. Load another checkpoint."
        )
    return value
