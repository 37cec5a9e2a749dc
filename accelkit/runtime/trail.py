"""The collective each thread entered last, for the hang watchdog's stack files.

accelkit's own collectives (:mod:`accelkit.runtime.ops`: gather, reduce, broadcast...,
``wait_for_everyone``, and through them the checkpoint and resume agreements) say here what they
enter (:func:`entering`: one dictionary write on the way in and one on the way out, about a
microsecond). When the watchdog finds a hang it writes :func:`describe`'s lines into the stack
file: for each thread, the last collective it entered, how long ago, and whether it returned. A
collective torch calls by itself (DDP's gradient all-reduce inside ``backward``) is not seen
here; the Python stacks show where those wait.

Public API: :func:`entering`, :func:`describe`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["describe", "entering"]

# thread ident -> (what, time.monotonic() when entered, whether it returned)
_TRAIL: dict[int, tuple[str, float, bool]] = {}


@contextlib.contextmanager
def entering(what: str) -> Iterator[None]:
    """Record that this thread enters the collective ``what`` (e.g. ``"all_reduce
    (accelkit.reduce)"``) until the block ends."""
    ident = threading.get_ident()
    start = time.monotonic()
    _TRAIL[ident] = (what, start, False)
    try:
        yield
    finally:
        _TRAIL[ident] = (what, start, True)


def describe(now: float | None = None) -> list[str]:
    """One line per thread that entered a collective: ``MainThread: all_reduce
    (accelkit.reduce), entered 12.3 s ago, not returned``."""
    now = time.monotonic() if now is None else now
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, (what, start, returned) in _TRAIL.copy().items():  # one C call: threads write
        name = names.get(ident, f"thread {ident} (ended)")
        state = "returned" if returned else "not returned"
        lines.append(f"{name}: {what}, entered {now - start:.1f} s ago, {state}")
    return lines
