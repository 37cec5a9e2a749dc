"""Every environment variable accelkit reads, in one table.

A variable is either an override of a documented default (``"you"`` set it: a tracker's
timeout, the lock's staleness, buffered writes) or a message from ``accelkit launch`` to the
workers it starts (``"launch"``). The settings themselves live in options objects and keyword
arguments; a variable never is the only way to say something a script says. The documentation
prints the same table (``docs/reference/environment.md``), and ``tests/test_env_table.py`` holds the
code, this table and that page to each other: a variable read anywhere in the package is here,
and every one here is documented with its default.

Reading goes through :func:`number` and :func:`switch`, which take the default from the table
and refuse a value that is not one (the message names the variable, the value and the fix).

Public API: :data:`VARIABLES`, :class:`Variable`, :func:`number`, :func:`switch`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = ["VARIABLES", "Variable", "number", "switch"]


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    Attributes:
        name: its name; a name ending in ``*`` is a family (``ACCELKIT_FSDP_*``).
        default: the value when it is unset, as written (``""``: unset means "not given").
        meaning: what it sets, in one line.
        setter: ``"you"`` (an override of a documented default) or ``"launch"`` (``accelkit
            launch`` sets it for its workers).
    """

    name: str
    default: str
    meaning: str
    setter: Literal["you", "launch"] = "you"


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        # the trackers (docs/guides/tracker-journal.md)
        Variable(
            "ACCELKIT_TRACKER_TIMEOUT",
            "60",
            "seconds a run may take to open, and `flush()`/`finish()` wait for the trackers",
        ),
        Variable(
            "ACCELKIT_TRACKER_DRAIN_S",
            "10",
            "seconds the end of a run gives a backend that does not answer (at most half the "
            "timeout)",
        ),
        Variable(
            "ACCELKIT_TRACKER_MAX_PENDING",
            "50000",
            "values that may wait behind a backend call older than the timeout",
        ),
        Variable(
            "ACCELKIT_TRACKER_RETRY_MAX_S",
            "30",
            "the longest wait between two tries of a backend that does not answer",
        ),
        Variable("ACCELKIT_TRACKER_JOURNAL", "1", "`0` turns the trackers' journal off"),
        Variable(
            "ACCELKIT_TRACKER_JOURNAL_MAX_MB", "1024", "the most megabytes of one tracker's journal"
        ),
        # checkpoints and storage
        Variable(
            "ACCELKIT_DIRECT_IO",
            "1",
            "`0` writes local checkpoint files through the page cache instead of `O_DIRECT`",
        ),
        Variable(
            "ACCELKIT_LOCK_STALE_S",
            "3600",
            "seconds after which a run lock whose holder cannot be checked is taken over",
        ),
        Variable(
            "ACCELKIT_PREFLIGHT_TIMEOUT",
            "30",
            "seconds the start-up check waits for `project_dir`'s storage to answer",
        ),
        # the process (Accelerate's ACCELERATE_* twins are read too)
        Variable("ACCELKIT_USE_CPU", "", "`1` runs on the CPU even with a GPU"),
        Variable("ACCELKIT_MIXED_PRECISION", "no", "the default `mixed_precision`"),
        Variable("ACCELKIT_DEBUG_MODE", "", "`1` checks the shapes of every collective"),
        Variable("ACCELKIT_LOG_LEVEL", "", "the level of `accelkit.logging.get_logger`"),
        Variable("ACCELKIT_DYNAMO_*", "", "`torch.compile` settings (`--dynamo_*` flags)"),
        Variable("ACCELKIT_USE_FSDP", "", "`1` turns FSDP on (`--use_fsdp`)"),
        Variable("ACCELKIT_FSDP_*", "", "the FSDP plugin's settings (`--fsdp_*` flags)"),
        # from the launcher to its workers
        Variable(
            "ACCELKIT_LAUNCH_PARENT_PID",
            "",
            "the launcher's pid: a worker dies with it",
            "launch",
        ),
        Variable(
            "ACCELKIT_LAUNCH_FAILURE_FILE",
            "",
            "where a worker records the error that ends it",
            "launch",
        ),
        Variable(
            "ACCELKIT_PREEMPTION_FILE",
            "",
            "where the main process records a preemption's exit code",
            "launch",
        ),
        Variable(
            "ACCELKIT_MEMORY_DIR",
            "",
            "the job's folder in shared memory, kept across restarts (the memory tier)",
            "launch",
        ),
        Variable(
            "ACCELKIT_PREEMPTION_JOB",
            "",
            "this launch's id, which a preemption record must carry",
            "launch",
        ),
    )
}


def _default(name: str) -> str:
    return VARIABLES[name].default  # a name outside the table is accelkit's own mistake


def number(name: str) -> float:
    """The non-negative, finite number in ``name`` (the table's default when unset or blank).

    Raises:
        ConfigurationError: it holds something else; the message names it and the fix.
    """
    default = _default(name)
    text = os.environ.get(name)
    if text is None or not text.strip():
        return float(default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or not math.isfinite(value):
        raise ConfigurationError(
            f"{name}={short(text)}: expected a non-negative number (default {default}). "
            "Set it to a number, or unset it."
        )
    return value


def switch(name: str) -> bool:
    """Whether ``name`` is on: ``0``, ``false``, ``no`` and ``off`` (any case) are off, any
    other value on, unset or blank is the table's default."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        text = _default(name)
    return text.strip().lower() not in ("0", "false", "no", "off", "")
