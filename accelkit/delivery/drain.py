"""One drain: a :class:`Deadline` that bounds every wait, :func:`drain` (wait until done or the
deadline), and :class:`ReportOnce` (what is left is said once, not at every try).

The end of a run waits for what it still has to deliver (the replication queue, a tracker's
journal) for a bounded time, then says once what is left and how to send it later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["Deadline", "ReportOnce", "drain"]


class Deadline:
    """The end of a bounded wait, ``seconds`` from now on the monotonic clock (``None``: no
    limit).

    Attributes:
        at: the ``time.monotonic()`` it ends at (``None``: never).
    """

    __slots__ = ("at",)

    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + max(0.0, seconds)

    def left(self) -> float | None:
        """Seconds left (0 once passed), ``None`` without a limit."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.at is not None and time.monotonic() >= self.at

    def within(self, seconds: float | None) -> float | None:
        """``seconds`` cut to what is left (a poll interval: ``None`` means no limit)."""
        left = self.left()
        if left is None:
            return seconds
        return left if seconds is None else min(left, seconds)

    def __repr__(self) -> str:
        left = self.left()
        return "Deadline(None)" if left is None else f"Deadline({left:.3f} s left)"


def drain(
    done: Callable[[], bool],
    deadline: Deadline,
    wait: Callable[[float | None], object],
    poll: float | None = 0.5,
) -> bool:
    """Wait until ``done()`` or ``deadline``; True if done.

    Args:
        done: whether there is nothing left to wait for (asked first, then after each wait).
        deadline: when to stop waiting.
        wait: blocks for at most the seconds it is given (``None``: until woken), e.g. a
            ``threading.Condition``'s ``wait`` (held by the caller) or an ``Event``'s.
        poll: the longest single wait (``None``: until ``wait`` returns), so that ``done`` is
            asked again even if nobody wakes the waiter.
    """
    while not done():
        if deadline.expired():
            return False
        wait(deadline.within(poll))
    return True


class ReportOnce:
    """Which things were said already (thread-safe): :meth:`first` is true once per key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` is given, then False."""
        with self._lock:
            if key in self._said:
                return False
            self._said.add(key)
            return True
