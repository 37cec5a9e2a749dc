"""What a tracker's worker queue holds: one typed item per request, handled in order.

:data:`Log` (values at a step), :class:`Mark` (set an event once everything before it is done:
a flush), :class:`Stop` (finish the tracker), :class:`Start` (open the run: continue a
checkpoint's run if one was loaded, start, store the configuration), :class:`GiveUp` (finish
and discard the run opened at ``init_trackers`` for a checkpoint's) and :class:`Checkpoint` (a
:class:`~accelkit.trackers.events.CheckpointEvent`); with them, what a worker is built with
(:class:`JournalSettings`) and what a resumed run continues (:class:`Resume`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeAlias

from accelkit.trackers.events import CheckpointEvent

__all__ = [
    "Checkpoint",
    "GiveUp",
    "Item",
    "JournalSettings",
    "Log",
    "Mark",
    "Resume",
    "Start",
    "Stop",
]


class JournalSettings(NamedTuple):
    """Where a worker keeps its tracker's journal, and what ``run.json`` records."""

    logging_dir: str
    name: str
    """The journal's folder name (the tracker's name; ``<name>.rank<k>`` off the main
    process)."""
    run: Mapping[str, Any]
    """The project name and constructor arguments, for ``accelkit track sync``."""
    max_bytes: int | None = None
    """The journal's disk cap (``None``: ``ACCELKIT_TRACKER_JOURNAL_MAX_MB`` or 1024 MB)."""


class Resume(NamedTuple):
    """What ``continue_run`` receives when a job resumes from a checkpoint (and ``fork_run``
    when it forks one)."""

    reference: dict[str, Any] | None
    """The reference the checkpoint recorded for this tracker's run (``None``: none)."""
    step: int
    """The checkpoint's last logging step."""
    fork: bool = False
    """Open a new run forked from the checkpoint's (``fork_run``) instead of continuing it."""


Log: TypeAlias = "tuple[Mapping[str, Any], int, Mapping[str, Any] | None, bool]"
"""Values to log: ``(values, step, kwargs, pending)``.

``values`` is the snapshot (:func:`accelkit.trackers.values.snapshot`), ``kwargs`` this
tracker's keyword arguments for ``log``, ``pending`` whether ``values`` holds device tensors
still to be read. The one item kind that is a plain tuple: it is built on every ``log()`` call of
the training loop, and a tuple literal costs a fraction of a ``NamedTuple``'s construction
(about 40 ns against 200 ns here, a third of ``log()``'s whole cost). Every other kind is a
``NamedTuple``, so a plain tuple in the queue is a ``Log`` and nothing else.
"""


class Start(NamedTuple):
    """Open the run: ``continue_run`` (``fork_run`` when ``resume.fork``), ``start``, store
    ``config``."""

    done: threading.Event
    config: Mapping[str, Any] | None
    resume: Resume | None


class GiveUp(NamedTuple):
    """Give up the open run for a checkpoint's: ``finish``, then ``discard_run``; its journal
    is closed with nothing left to send (the next :class:`Start` opens the checkpoint's run)."""

    done: threading.Event


class Mark(NamedTuple):
    """Set ``done`` once every item before it is handled (a flush)."""

    done: threading.Event


class Stop(NamedTuple):
    """Finish the tracker, set ``done`` and end the thread."""

    done: threading.Event


class Checkpoint(NamedTuple):
    """Hand a checkpoint event to the tracker's ``on_checkpoint``."""

    event: CheckpointEvent


Item: TypeAlias = "Log | Start | GiveUp | Mark | Stop | Checkpoint"
