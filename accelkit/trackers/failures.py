"""What the hub reports when a tracker fails: `TrackerFailure`, `TrackerWarning`, `TrackerError`."""

from __future__ import annotations

from dataclasses import dataclass

from accelkit.errors import AccelkitError

__all__ = ["TrackerError", "TrackerFailure", "TrackerWarning"]


class TrackerWarning(UserWarning):
    """A tracker failed and is skipped from now on (``on_error="warn"``)."""


class TrackerError(AccelkitError, RuntimeError):
    """A tracker failed (``on_error="raise"``); ``failure`` says which and where."""

    def __init__(self, failure: TrackerFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


@dataclass(frozen=True)
class TrackerFailure:
    """One tracker failure: which tracker, in which method, and the exception."""

    name: str
    method: str
    error: BaseException

    def describe(self) -> str:
        """A one-line report naming the tracker and the error."""
        return (
            f"Tracker {self.name!r} failed in {self.method}(): {type(self.error).__name__}: "
            f"{self.error}. It is skipped from now on; the other trackers continue."
        )
