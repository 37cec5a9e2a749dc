"""Sending later what a run could not deliver: the work behind ``accelkit track sync``/``status``.

A run whose backend did not come back (or a job killed while it was catching up) leaves
undelivered entries in its trackers' journals (:mod:`accelkit.trackers.journal`).
:func:`sync` opens the same run again (the reference is in the journal's ``run.json``: the
tracker's ``continue_run`` before its ``start``, as a resumed job does), sends the entries after
the last acknowledged one in order with their original steps, recording each as delivered right
after the backend accepts it, and finishes the run. Run it once the job has ended: a journal is
written by one process at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from accelkit.trackers._worker import deliver
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.journal import Entry, Journal, JournalStatus, journal_folders
from accelkit.trackers.registry import constructor_arguments, get_tracker_class

__all__ = ["SyncResult", "status", "sync", "sync_folder"]


@dataclass
class SyncResult:
    """What :func:`sync` did for one journal.

    Attributes:
        name: the tracker's name.
        folder: the journal's folder.
        sent: entries delivered now.
        first_seq: the first entry sent (``None``: none).
        last_seq: the last entry sent (``None``: none).
        pending: entries still undelivered afterwards.
        error: why it stopped early (``None``: it did not).
        problems: what could not be read in the journal, one line each.
    """

    name: str
    folder: str
    sent: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    pending: int = 0
    error: str | None = None
    problems: list[str] = field(default_factory=list)


def _load(folder: str) -> Journal:
    journal = Journal(folder)
    journal.load()
    return journal


def status(logging_dir: str) -> list[JournalStatus]:
    """Per journal under ``logging_dir``: entries journaled, delivered and pending."""
    out = []
    for folder in journal_folders(logging_dir):
        journal = _load(folder)
        out.append(journal.status(os.path.basename(folder)))
    return out


def sync(
    logging_dir: str,
    tracker: str | None = None,
    *,
    on_sent: Callable[[Entry], None] | None = None,
) -> list[SyncResult]:
    """Deliver every journal's undelivered entries under ``logging_dir`` to its run.

    Args:
        logging_dir: the run's logging directory.
        tracker: only the journals of this tracker (its name).
        on_sent: called after each delivered entry.

    Returns:
        One :class:`SyncResult` per journal looked at.
    """
    results = []
    for folder in journal_folders(logging_dir):
        journal = _load(folder)
        run = journal.read_run() or {}
        name = run.get("tracker")
        if not isinstance(name, str) or not name:
            name = os.path.basename(folder).split(".rank", 1)[0]
        if tracker is not None and name != tracker:
            continue
        result = SyncResult(name, folder, problems=list(journal.problems))
        results.append(result)
        if not journal.pending(limit=1):
            continue
        try:
            instance = _build(name, run, logging_dir)
        except Exception as error:
            result.error = f"{type(error).__name__}: {error}"
            result.pending = len(journal.pending())
            continue
        sync_folder(instance, journal, run.get("reference"), result, on_sent)
    return results


def _build(name: str, run: dict[str, object], logging_dir: str) -> GeneralTracker:
    cls = get_tracker_class(name)
    project = run.get("project_name")
    kwargs = run.get("init_kwargs")
    args, named = constructor_arguments(
        cls,
        project if isinstance(project, str) else "",
        logging_dir,
        kwargs if isinstance(kwargs, dict) else {},
    )
    return cls(*args, **named)


def sync_folder(
    tracker: GeneralTracker,
    journal: Journal,
    reference: object,
    result: SyncResult,
    on_sent: Callable[[Entry], None] | None = None,
) -> SyncResult:
    """Continue ``reference``'s run with ``tracker`` and send ``journal``'s undelivered
    entries (for a tracker :func:`sync` cannot build: one not registered in this process)."""
    last_step = journal.last_step()

    def sent(entry: Entry) -> None:
        result.sent += 1
        if result.first_seq is None:
            result.first_seq = entry.seq
        result.last_seq = entry.seq
        if on_sent is not None:
            on_sent(entry)

    started = False
    try:
        if isinstance(reference, dict):
            tracker.continue_run(dict(reference), last_step)
        tracker.start()
        started = True
        deliver(tracker, journal, sent)
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        try:
            if started:
                tracker.finish()
        except Exception as error:
            result.error = result.error or f"finish(): {type(error).__name__}: {error}"
        journal.close()
    result.pending = len(journal.pending())
    result.problems = list(journal.problems)
    return result
