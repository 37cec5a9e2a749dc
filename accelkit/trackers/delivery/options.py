"""``TrackerOptions``: how long the trackers are waited for, retried and journaled.

``Accelerator(tracker_options=TrackerOptions(...))``. A field left ``None`` takes its
environment variable's value if one is set (the override table, ``docs/reference/
environment.md``), else the documented default; a field given wins over the variable.

Public API: :class:`TrackerOptions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from accelkit._text import short
from accelkit.errors import ConfigurationError, WrongTypeError

__all__ = ["TrackerOptions"]

_VARIABLES = {
    "timeout": "ACCELKIT_TRACKER_TIMEOUT",
    "drain_seconds": "ACCELKIT_TRACKER_DRAIN_S",
    "max_pending": "ACCELKIT_TRACKER_MAX_PENDING",
    "retry_max_seconds": "ACCELKIT_TRACKER_RETRY_MAX_S",
    "journal": "ACCELKIT_TRACKER_JOURNAL",
    "journal_max_mb": "ACCELKIT_TRACKER_JOURNAL_MAX_MB",
}


@dataclass(frozen=True)
class TrackerOptions:
    """The trackers' waits, retries and journal (see ``docs/guides/tracker-journal.md``).

    Args:
        timeout: the most seconds a run may take to open, one backend call may run while values
            pile up behind it, and ``flush()``/``end_training()`` wait for the trackers
            (``ACCELKIT_TRACKER_TIMEOUT``, 60).
        drain_seconds: the most seconds the end of a run gives a journaled tracker whose backend
            does not answer; what it has not sent stays in its journal for ``accelkit track
            sync`` (``ACCELKIT_TRACKER_DRAIN_S``, 10; at most half of ``timeout``).
        max_pending: values that may wait behind a backend call older than ``timeout``
            before the tracker is handled as hung (``ACCELKIT_TRACKER_MAX_PENDING``, 50 000).
        retry_max_seconds: the longest wait between two tries of a backend that does not answer
            (``ACCELKIT_TRACKER_RETRY_MAX_S``, 30; the first retry comes after 0.5 s).
        journal: keep a journal per tracker under the logging directory, so that an outage
            loses nothing (``ACCELKIT_TRACKER_JOURNAL``, on).
        journal_max_mb: the most megabytes of one tracker's journal; past it the oldest
            undelivered values are dropped, said once (``ACCELKIT_TRACKER_JOURNAL_MAX_MB``,
            1024).

    Raises:
        ConfigurationError: a negative, infinite or non-numeric number, or ``max_pending`` < 1;
            the message names the field and the fix.
    """

    timeout: float | None = None
    drain_seconds: float | None = None
    max_pending: int | None = None
    retry_max_seconds: float | None = None
    journal: bool | None = None
    journal_max_mb: float | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.name == "journal":
                if not isinstance(value, bool):
                    raise WrongTypeError(
                        f"TrackerOptions(journal={short(value)}): expected True or False."
                    )
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise WrongTypeError(
                    f"TrackerOptions({field.name}={short(value)}): expected a number, or None "
                    f"for {_VARIABLES[field.name]} or the default."
                )
            low = 1 if field.name == "max_pending" else 0
            if not math.isfinite(value) or value < low:
                raise ConfigurationError(
                    f"TrackerOptions({field.name}={short(value)}): expected a finite number "
                    f">= {low}. Give one, or None for {_VARIABLES[field.name]} or the default."
                )
