"""Journaled delivery: `Outbox`, what a tracker's worker has accepted and not yet delivered.

With a journal (:class:`~accelkit.trackers.delivery.items.JournalSettings`, see
:mod:`accelkit.trackers.delivery.journal`), each batch of requests is written to the tracker's
journal before the backend sees it, and each accepted call's ``seq`` is recorded right after it
returns. A backend that raises is tried again with backoff
(:func:`~accelkit.trackers.delivery.failures.classify`): values keep being journaled meanwhile,
and are sent in order, with their original steps, once it answers again. At the end of the run
:meth:`Outbox.drain` keeps trying for a bounded time; what is left stays journaled for
``accelkit track sync``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from typing import Any

from accelkit.delivery.drain import Deadline
from accelkit.delivery.failures import HARD, REFUSED
from accelkit.trackers.delivery.failures import classify
from accelkit.trackers.delivery.items import Checkpoint, Item, JournalSettings, Resume
from accelkit.trackers.delivery.journal import Entry, Journal
from accelkit.trackers.delivery.send import (
    MEMORY,
    SEND_BATCH,
    batch_length,
    call,
    has_log_batch,
    settle,
)
from accelkit.trackers.delivery.session import TrackerSession
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.values import resolve

__all__ = ["Outbox"]

_BATCH = 4096  # requests journaled per write


class Outbox:
    """A tracker's journal and the entries it has not delivered yet, in order.

    Args:
        session: the tracker's calls and state.
        settings: where to keep the journal (``None``: no journal; values go straight to the
            tracker).

    Attributes:
        journal: the open journal (``None``: none, or it could not be used: reported once).
    """

    def __init__(self, session: TrackerSession, settings: JournalSettings | None) -> None:
        self.session = session
        self.settings = settings
        self.journal: Journal | None = None
        # Held while entries are numbered and written, and while the journal closes: the hub's
        # thread journals the queue itself when the worker hangs in a backend call (adopt).
        self.lock = threading.RLock()
        # Undelivered entries in order, with the live values (``None``: read from disk).
        self._pending: collections.deque[tuple[Entry, Any]] = collections.deque()
        self._on_disk = False  # undelivered entries exist on disk beyond those in memory
        self._singly = 0  # entries to send one at a time (a batch holding a refused value)

    @property
    def folder(self) -> str | None:
        """The journal's folder (``None`` without one)."""
        journal = self.journal
        return journal.folder if journal is not None else None

    def holds(self) -> bool:
        """Whether entries wait to be delivered (in memory or on disk)."""
        return bool(self._pending) or self._on_disk

    # ------------------------------------------------------------------ the journal

    def open_run(self, config: Mapping[str, Any] | None, resume: Resume | None) -> None:
        """Open the tracker's run: its journal first (what is logged while a backend call
        hangs is journaled by the hub, in the run named here), then ``continue_run`` when a
        job resumes (``fork_run`` when it forks: a new run, and a new journal), ``start()``
        (retried with backoff while the journal keeps the values), the configuration
        (journaled and sent like a value)."""
        session = self.session
        tracker = session.tracker
        if self.settings is not None:
            try:
                self.journal = _open_journal(self.settings, resume)
                self._on_disk = self.journal.acked < self.journal.next_seq - 1
            except OSError as error:
                self._journal_broken(error)
            self.write_run()
        if resume is not None:
            name = "fork_run" if resume.fork else "continue_run"
            if not session.call(name, getattr(tracker, name), resume.reference, resume.step):
                return
        if self.journal is None:  # none, or it could not be used (reported): no retrying
            # (a start() that returned after its time limit was reported: not failed again)
            if session.start(retry=False):
                if config is not None:
                    session.call(
                        "store_init_configuration", tracker.store_init_configuration, config
                    )
                session.take_reference()
            return
        self.try_start()
        if config is not None and self.journal is not None and not session.failed:
            with self.lock:
                if self.journal is not None:
                    self._record([(self.journal.entry("config", -1, config), config)])
            self.deliver()

    def try_start(self) -> bool:
        """``start()`` once more (see :meth:`TrackerSession.start`); once the run is open, its
        reference is recorded in the journal."""
        if not self.session.start(retry=self.journal is not None, journal=self.folder):
            return False
        self.session.take_reference()
        self.write_run()
        return True

    def write_run(self) -> None:
        """Record the run (``run.json``): settings and the run's reference, or the planned
        one before it opens."""
        settings = self.settings
        if self.journal is None or settings is None:
            return
        session = self.session
        try:
            reference = session.reference if session.reference is not None else session.planned
            self.journal.write_run({**settings.run, "reference": reference})
        except OSError as error:
            self._journal_broken(error)

    def journal_logs(self, items: collections.deque[Item]) -> None:
        """Journal the ``Log`` requests at the head of ``items`` (one write), then send."""
        with self.lock:
            journal = self.journal
            if journal is None:
                return
            batch: list[tuple[Entry, Any]] = []
            append = batch.append
            entry = journal.entry
            while items and type(items[0]) is tuple and len(batch) < _BATCH:
                try:
                    item = items.popleft()
                except IndexError:  # adopted by the hub's thread meanwhile
                    break
                if type(item) is not tuple:  # a control item: back to the head, in order
                    items.appendleft(item)
                    break
                values, step, kwargs, pending = item  # type: ignore[misc]
                values = resolve(values) if pending else dict(values)  # this tracker's copy
                # Plain values (the usual numbers) are journaled as they are: the same dict.
                append(
                    (
                        entry("log", step, values, {"kwargs": dict(kwargs)} if kwargs else None),
                        values,
                    )
                )
            self._record(batch)
        self.deliver()

    def journal_event(self, event: CheckpointEvent) -> None:
        """Journal a checkpoint event, then send."""
        with self.lock:
            journal = self.journal
            if journal is not None:
                fields = event.journal_fields()
                entry = journal.entry("event", event.step, dict(event.values), fields)
                self._record([(entry, event)])
        self.deliver()

    def _record(self, batch: list[tuple[Entry, Any]]) -> None:
        with self.lock:
            journal = self.journal
            if journal is None or not batch:
                return
            try:
                journal.write([entry for entry, _ in batch])
            except OSError as error:
                self._journal_broken(error)
            if self._on_disk or len(self._pending) + len(batch) > MEMORY:
                self._on_disk = True
            else:
                self._pending.extend(batch)

    def adopt(self, items: collections.deque[Item]) -> int:
        """Journal ``items`` (the worker's queue) from the calling thread while the worker
        hangs in a backend call.

        Called by the hub when it gives up waiting for the worker (the queue outgrew
        ``max_pending`` behind a call that does not return, or ``finish`` ran out of time): the
        values and checkpoint events waiting in the queue are numbered and written to the
        journal in their order, so nothing queued is lost when the process ends. The worker
        sends them from the journal once its call returns (or ``accelkit track sync`` does).
        Control items (a flush mark, the stop) stay queued, in order.

        Returns:
            How many entries were journaled (0 without a journal or with nothing waiting).
        """
        with self.lock:
            journal = self.journal
            if journal is None:
                return 0
            batch = _take_entries(journal, items, events=not self.session.failed)
            if not batch:
                return 0
            try:
                journal.write([entry for entry, _ in batch])
            except OSError as error:
                self._journal_broken(error)
                return 0
            self._on_disk = True  # behind what the worker holds in memory: read back in order
            return len(batch)

    def _journal_broken(self, error: BaseException) -> None:
        """Go on without the journal (reported once); what is in memory is still sent."""
        journal, self.journal = self.journal, None
        self._on_disk = False
        self.session.policy.journal_off(self.session.name, error)
        if journal is not None:
            try:
                journal.close()
            except OSError:
                pass

    def close(self, given_up: bool = False) -> None:
        """Close the journal at the end of the run, saying how many entries it still holds;
        ``given_up``: the run was given up for a checkpoint's (``GiveUp``): its entries,
        the configuration at most, which the next :meth:`open_run` stores again, are marked
        delivered, so nothing ever sends them to that run (that opening removes the journal)."""
        with self.lock:  # after an adoption in flight has written its entries
            closing = self.journal
            if given_up:
                self._pending.clear()
                if closing is not None:
                    closing.ack(closing.next_seq - 1)
            if closing is None:
                return
            left = closing.next_seq - 1 - closing.acked
            if left > 0 and not self.session.failed:  # a failed tracker was reported already
                self.session.policy.undelivered(self.session.name, left, closing.folder)
            try:
                closing.close()
            except OSError:
                pass

    # ------------------------------------------------------------------ delivery

    def deliver(self, *, force: bool = False) -> None:
        """Send undelivered entries in order until one fails; a backend that does not answer
        is tried again after the session's backoff.

        A tracker with its own ``log_batch`` receives runs of ``log`` entries (all that are
        waiting, up to ``SEND_BATCH`` entries and its ``max_batch_values``) in one call, each
        run recorded as delivered when the call returns; the others receive one call per entry.
        """
        session = self.session
        if session.failed or not session.started:
            return
        if not force and time.monotonic() < session.backoff.retry_at:
            return
        pending = self._pending
        tracker = session.tracker
        batched = has_log_batch(tracker)
        while True:
            if not pending:
                if not self._on_disk or self.journal is None:
                    break
                self._refill()
                if not pending:
                    break
            journal = self.journal
            if journal is not None and journal.in_doubt is not None:
                doubt = journal.in_doubt
                entries = []
                for entry, _ in pending:
                    if entry.seq > doubt:
                        break
                    entries.append(entry)
                for _ in range(settle(tracker, journal, entries)):
                    pending.popleft()
                continue
            if not batched and journal is not None and pending[0][0].kind == "log":
                outcome = self._send_logs(pending, journal)
                if outcome == "retry" or outcome == "fatal":
                    return
                continue
            count = 1
            if batched and not self._singly:
                count = batch_length(
                    tracker, [pending[i][0] for i in range(min(len(pending), SEND_BATCH))]
                )
            group = [pending[i] for i in range(count)] if count > 1 else [pending[0]]
            if journal is not None:
                try:
                    journal.sending(group[-1][0].seq)
                except OSError as error:
                    self._journal_broken(error)
            outcome = self._send(group, batched)
            if outcome == "retry" or outcome == "fatal":
                return
            if outcome == "split":  # a refused value in a batch: find it, one entry at a time
                self._singly = count
                continue
            for _ in range(count):
                pending.popleft()
            if self._singly:
                self._singly = max(0, self._singly - count)
            if self.journal is not None:
                try:
                    self.journal.ack(group[-1][0].seq)
                except OSError as error:
                    self._journal_broken(error)
        lasted = session.backoff.answered()
        if lasted is not None:
            session.policy.recovered(session.name, lasted)

    def drain(self) -> None:
        """At the end of the run, keep trying to deliver (and to start a backend whose
        ``start()`` is being retried), with the backoff, for at most the policy's ``drain``
        seconds (``ACCELKIT_TRACKER_DRAIN_S``, 10 by default, and half the tracker timeout);
        what is left stays journaled."""
        session = self.session
        if not (self.holds() or session.start_waiting):
            return
        # Within the hub's wait for finish, so the run ends without a warning.
        deadline = Deadline(session.policy.drain)
        if session.start_waiting:
            self.try_start()
        self.deliver(force=True)
        while (
            (self.holds() or session.start_waiting)
            and not session.failed
            and (session.started or session.start_waiting)
        ):
            pause = max(0.0, session.backoff.retry_at - time.monotonic())
            if deadline.expired() or pause > (deadline.left() or 0.0):
                break
            time.sleep(pause)
            if session.start_waiting:
                self.try_start()
            self.deliver()

    def _refill(self) -> None:
        with self.lock:  # never half of an adoption's write
            journal = self.journal
            if journal is None:  # given up meanwhile (reported): nothing to read back
                self._on_disk = False
                return
            entries = journal.pending(limit=MEMORY)
            self._pending.extend((entry, None) for entry in entries)
            if not entries or entries[-1].seq >= journal.next_seq - 1:
                self._on_disk = False

    def _send_logs(self, pending: collections.deque[tuple[Entry, Any]], journal: Journal) -> str:
        """Send the ``log`` entries at the head of ``pending`` with one ``log`` call each (a
        tracker without ``log_batch``), each marked as being sent before its call and as
        delivered right after: the worker's inner loop, kept lean (it runs once per value set
        and tracker, on a thread that shares the GIL with the training loop). Returns the
        outcome of the last call (``"ok"`` when a run of entries went out)."""
        session = self.session
        log = session.tracker.log
        monotonic = time.monotonic
        outcome = "ok"
        try:
            sent = 0
            while pending and sent < SEND_BATCH:
                entry, live = pending[0]
                if entry.kind != "log":
                    break
                journal.sending(entry.seq)
                session.busy = "log"
                session.busy_since = monotonic()
                try:
                    kwargs = entry.extra.get("kwargs") if entry.extra else None
                    values = live if live is not None else dict(entry.values)
                    if kwargs:
                        log(values, entry.step, **kwargs)
                    else:
                        log(values, entry.step)
                except Exception as error:
                    session.busy = None
                    outcome = self._failed_send(error, "log", [(entry, live)])
                    if outcome != "skip":
                        return outcome
                session.busy = None
                pending.popleft()
                journal.ack(entry.seq)
                sent += 1
        except OSError as error:  # the journal's own files (the tracker's errors are above)
            self._journal_broken(error)
        return outcome

    def _send(self, group: list[tuple[Entry, Any]], batched: bool) -> str:
        """Hand entries to the backend: ``"ok"``, ``"skip"`` (refused: reported, not sent
        again), ``"split"`` (a batch was refused: send its entries one by one to find the
        value), ``"retry"`` or ``"fatal"`` (the tracker is failed)."""
        session = self.session
        entry = group[0][0]
        method = {"log": "log", "config": "store_init_configuration"}.get(
            entry.kind, "on_checkpoint"
        )
        if batched and entry.kind == "log" and not entry.extra:
            method = "log_batch"
        session.busy = method
        session.busy_since = time.monotonic()
        try:
            if method == "log_batch":
                session.tracker.log_batch(
                    [
                        (live if live is not None else dict(e.values), e.step, e.time)
                        for e, live in group
                    ]
                )
            else:
                call(session.tracker, entry, group[0][1])
            return "ok"
        except Exception as error:
            return self._failed_send(error, method, group)
        finally:
            session.busy = None

    def _failed_send(self, error: Exception, method: str, group: list[tuple[Entry, Any]]) -> str:
        session = self.session
        entry = group[0][0]
        if entry.kind == "event":
            session.degrade(f"on_checkpoint() failed ({type(error).__name__}: {error})")
            return "skip"
        verdict = classify(error)
        if verdict == REFUSED:
            if len(group) > 1:
                return "split"
            session.policy.refused(session.name, method, entry.seq, entry.step, error)
            return "skip"
        if verdict == HARD:
            session.fail(method, error)
            return "fatal"
        session.retry_later(method, error, self.folder)
        return "retry"


def _same_run(recorded: object, reference: Mapping[str, Any] | None) -> bool:
    """Whether a journal's run (``run.json``) is the run a checkpoint's ``reference`` names:
    equal, or holding every field of it (a run named before it opened, as MLflow's is by its
    run key, gains fields once open)."""
    if recorded == reference:
        return True
    return (
        isinstance(recorded, Mapping)
        and bool(reference)
        and all(recorded.get(key) == value for key, value in (reference or {}).items())
    )


def _open_journal(settings: JournalSettings, resume: Resume | None) -> Journal:
    """The tracker's journal: the resumed run's own (cut after its checkpoint's step), else a
    new one, a previous run's (for ``accelkit track sync``) or a damaged one set aside."""
    journal = Journal.open(settings.logging_dir, settings.name, max_bytes=settings.max_bytes)
    if journal.next_seq or journal.problems:
        run = None if journal.problems else journal.read_run()
        if (
            run is not None
            and resume is not None
            and not resume.fork
            and _same_run(run.get("reference"), resume.reference)
        ):
            journal.drop_after(resume.step)  # the resumed run logs those again
            journal.load()
        else:
            journal.set_aside()
            journal = Journal.open(
                settings.logging_dir, settings.name, max_bytes=settings.max_bytes
            )
    return journal


def _take_entries(
    journal: Journal, items: collections.deque[Item], *, events: bool
) -> list[tuple[Entry, Any]]:
    """Number the values (and, with ``events``, the checkpoint events) queued in ``items`` as
    journal entries, in order, taking them off the queue; control items stay queued, in
    order."""
    kept: list[Item] = []
    batch: list[tuple[Entry, Any]] = []
    while True:
        try:
            item = items.popleft()
        except IndexError:
            break
        if type(item) is tuple:
            values, step, kwargs, pending = item  # type: ignore[misc]
            values = resolve(values) if pending else dict(values)
            options = {"kwargs": dict(kwargs)} if kwargs else None
            batch.append((journal.entry("log", step, values, options), values))
        elif isinstance(item, Checkpoint) and events:
            event = item.event
            fields = event.journal_fields()
            entry = journal.entry("event", event.step, dict(event.values), fields)
            batch.append((entry, event))
        else:
            kept.append(item)
    for item in reversed(kept):
        items.appendleft(item)
    return batch
