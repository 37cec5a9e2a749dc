"""One tracker's queue and the daemon thread that empties it (the hub's building block).

The queue holds one typed item per request (:mod:`accelkit.trackers.delivery.items`), handled
in order. The thread hands each to the tracker's
:class:`~accelkit.trackers.delivery.session.TrackerSession` (the calls, the run's opening, the
state the hub reads) or, with a journal, to its :class:`~accelkit.trackers.delivery.outbox.Outbox`
(journaled delivery with backoff). What a failure or a hang costs is the
:class:`~accelkit.trackers.delivery.failures.FailurePolicy`'s decision, which the worker
receives.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.delivery.failures import FailurePolicy
from accelkit.trackers.delivery.items import (
    Checkpoint,
    GiveUp,
    Item,
    JournalSettings,
    Log,
    Mark,
    Start,
    Stop,
)
from accelkit.trackers.delivery.outbox import Outbox
from accelkit.trackers.delivery.session import TrackerSession
from accelkit.trackers.values import resolve

__all__ = ["POLL_S", "WAKE_AT", "Worker"]

POLL_S = 0.05
# Queued items at which log() wakes the thread at once (below, it drains every POLL_S).
WAKE_AT = 256


class Worker:
    """A tracker's queue and the daemon thread that feeds it.

    :meth:`log` only appends to a deque (no lock, no system call): waking a sleeping thread on
    every call would cost the caller a futex wake-up, several microseconds on a busy machine.
    The worker instead drains the deque every ``POLL_S`` seconds, or at once when the queue
    grows past ``WAKE_AT`` items or a flush/finish asks for it (:meth:`signal`).

    Args:
        tracker: the tracker this worker feeds.
        policy: what a failure or a hang costs (shared by the run's workers).
        journal: where to keep the tracker's journal (``None``: no journal).

    Attributes:
        session: the tracker's calls and the state of its run (started, failed, busy,
            reference, planned, opened).
        outbox: the tracker's journal and what it has not delivered yet.
    """

    def __init__(
        self,
        tracker: GeneralTracker,
        policy: FailurePolicy,
        journal: JournalSettings | None = None,
    ) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.session = TrackerSession(tracker, policy)
        self.outbox = Outbox(self.session, journal)
        self._items: collections.deque[Item] = collections.deque()
        self._wake = threading.Event()
        self._hung_said = False  # kept_while_hung was said
        self.thread = threading.Thread(
            target=self._run, name=f"accelkit-tracker-{self.name}", daemon=True
        )
        self.thread.start()

    # ------------------------------------------------------------------ the caller's side

    def log(self, item: Log) -> None:
        """Queue values to log (the training loop's hot path: an append, rarely a wake-up).

        Past ``WAKE_AT`` waiting items the thread is woken; past the policy's ``max_pending``
        behind a backend call that does not return, see :meth:`overflow`.
        """
        items = self._items
        items.append(item)
        if len(items) >= WAKE_AT:
            self._wake.set()
            session = self.session
            if len(items) > session.policy.max_pending and session.stuck():
                self.overflow()

    def put(self, item: Checkpoint) -> None:
        """Queue a checkpoint event (safe from any thread); handled at the next drain."""
        self._items.append(item)

    def signal(self, make: Callable[[threading.Event], Item]) -> threading.Event:
        """Queue the item ``make(done)`` and wake the worker; ``done`` is set once it is
        handled (``make`` is :class:`Mark`, :class:`Stop` or a partial :class:`Start`)."""
        done = threading.Event()
        self._items.append(make(done))
        self._wake.set()
        return done

    def waiting(self) -> int:
        """How many items are queued."""
        return len(self._items)

    def adopt(self) -> int:
        """Journal what waits in the queue from the calling thread, while the worker hangs in a
        backend call (see :meth:`Outbox.adopt <accelkit.trackers.delivery.outbox.Outbox.adopt>`).

        Returns:
            How many entries were journaled.
        """
        return self.outbox.adopt(self._items)

    def overflow(self) -> None:
        """Its queue outgrew the policy's ``max_pending`` behind a backend call that does not
        return. With a journal, the values waiting are journaled from the calling thread
        (:meth:`adopt`) and sent once the backend answers, said once; without one, the tracker
        is skipped: the values waiting are dropped and the failure is reported."""
        session, outbox = self.session, self.outbox
        policy = session.policy
        journal = outbox.journal
        if journal is not None and self.adopt() and outbox.journal is not None:
            if not self._hung_said:
                self._hung_said = True
                policy.kept_while_hung(self.name, session.busy, journal.folder)
            return
        waiting = len(self._items)
        busy = session.busy
        if not session.mark_failed():
            return
        self._items.clear()
        policy.report(policy.overflowed(self.name, waiting, busy))

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        items = self._items
        session = self.session
        outbox = self.outbox
        backoff = session.backoff
        while True:
            self._wake.clear()
            while items:
                if outbox.journal is not None and type(items[0]) is tuple and not session.failed:
                    outbox.journal_logs(items)
                    continue
                if self._handle(items.popleft()):
                    return
            wait = POLL_S
            if (
                session.start_waiting
                and time.monotonic() >= backoff.retry_at
                and outbox.try_start()
            ):
                outbox.deliver()  # what was journaled meanwhile; says it answers again
            if outbox.holds() or session.start_waiting:
                outbox.deliver()
                if backoff.retry_at:
                    wait = min(POLL_S, max(0.0005, backoff.retry_at - time.monotonic()))
            self._wake.wait(wait)

    def _handle(self, item: Item) -> bool:
        """Process one queued item; True once the tracker is finished."""
        session = self.session
        if not isinstance(item, (Checkpoint, Start, Stop, Mark, GiveUp)):
            if not session.failed:
                values, step, kwargs, pending = item
                values = resolve(values) if pending else dict(values)
                session.call("log", self.tracker.log, values, step, **(kwargs or {}))
            return False
        if isinstance(item, Checkpoint):
            if not session.failed and (session.started or session.start_waiting):
                if self.outbox.journal is not None:
                    self.outbox.journal_event(item.event)
                else:
                    session.checkpoint(item.event)
            return False
        if isinstance(item, Start):
            if not session.failed:
                self.outbox.open_run(item.config, item.resume)
            session.opened.set()
            item.done.set()
            return False
        if isinstance(item, GiveUp):
            if not session.failed:
                self.outbox.close(given_up=True)
                session.give_up()
            item.done.set()
            return False
        if isinstance(item, Stop):
            self.outbox.drain()
            self.outbox.close()
            # A backend that still does not answer is not asked to finish its run (its client
            # would retry past the end of the job): `accelkit track sync` finishes it.
            if not session.failed and session.started and session.backoff.outage is None:
                session.call("finish", self.tracker.finish)
            item.done.set()
            return True
        item.done.set()  # a Mark
        return False
