"""One tracker, its queue and the daemon thread that feeds it (the hub's building block).

The queue holds one typed item per request, handled in order: :class:`Log` (values at a step),
:class:`Mark` (set an event once everything before it is done: flush), :class:`Stop` (finish the
tracker), :class:`Start` (open the run: continue a checkpoint's run if one was loaded, start,
store the configuration) and :class:`Checkpoint` (a
:class:`~accelkit.trackers.events.CheckpointEvent`). What a failure or a hang costs is the
:class:`~accelkit.trackers.failures.FailurePolicy`'s decision, which the worker receives.

With a journal (:class:`JournalSettings`, see :mod:`accelkit.trackers.journal`), the worker
writes each batch of requests to the tracker's journal before calling the backend, records each
accepted call's ``seq`` right after it returns, and retries a backend that raises with backoff
(:func:`~accelkit.trackers.failures.classify`): values keep being journaled meanwhile, and are
sent in order, with their original steps, once it answers again.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, TypeAlias

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.failures import FailurePolicy, TrackerFailure, classify, env_number
from accelkit.trackers.journal import Entry, Journal, JournalWarning
from accelkit.trackers.values import resolve

__all__ = [
    "Checkpoint",
    "Item",
    "JournalSettings",
    "Log",
    "Mark",
    "Resume",
    "Start",
    "Stop",
    "Worker",
    "deliver",
    "settle",
]

POLL_S = 0.05
_BATCH = 4096  # requests journaled per write
_MEMORY = 65_536  # undelivered entries kept in memory; beyond, they are read back from disk
_FIRST_RETRY_S = 0.5
# Entries handed to one ``log_batch`` call at most (and the tracker's ``max_batch_values``):
# a catch-up after an outage goes out in requests of this size, each acknowledged on its own.
_SEND_BATCH = 200


def _max_retry_s() -> float:
    return env_number("ACCELKIT_TRACKER_RETRY_MAX_S", 30.0)


class JournalSettings(NamedTuple):
    """Where a worker keeps its tracker's journal, and what ``run.json`` records."""

    logging_dir: str
    name: str
    """The journal's folder name (the tracker's name; ``<name>.rank<k>`` off the main
    process)."""
    run: Mapping[str, Any]
    """The project name and constructor arguments, for ``accelkit track sync``."""


class Resume(NamedTuple):
    """What ``continue_run`` receives when a job resumes from a checkpoint."""

    reference: dict[str, Any] | None
    """The reference the checkpoint recorded for this tracker's run (``None``: none)."""
    step: int
    """The checkpoint's last logging step."""


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
    """Open the run: ``continue_run`` (with ``resume``), ``start``, store ``config``."""

    done: threading.Event
    config: Mapping[str, Any] | None
    resume: Resume | None


class Mark(NamedTuple):
    """Set ``done`` once every item before it is handled (a flush)."""

    done: threading.Event


class Stop(NamedTuple):
    """Finish the tracker, set ``done`` and end the thread."""

    done: threading.Event


class Checkpoint(NamedTuple):
    """Hand a checkpoint event to the tracker's ``on_checkpoint``."""

    event: CheckpointEvent


Item: TypeAlias = "Log | Start | Mark | Stop | Checkpoint"


class Worker:
    """A tracker, its queue and the daemon thread that feeds it.

    ``log`` only appends to a deque (no lock, no system call): waking a sleeping thread on
    every call would cost the caller a futex wake-up, several microseconds on a busy machine.
    The worker instead drains the deque every ``POLL_S`` seconds, or at once when the queue
    grows past the hub's wake-up size or a flush/finish asks for it.

    Args:
        tracker: the tracker this worker feeds.
        policy: what a failure or a hang costs (shared by the run's workers).

    Attributes:
        started: ``start()`` returned (the backend's run is open).
        reference: what the tracker's ``run_reference()`` returned after its start.
        planned: the reference of the run it is opening, known before its start (set by the
            hub: the tracker's ``name_run()``, or the checkpoint's reference it continues).
        opened: set once the worker handled its start (successfully or not).
    """

    def __init__(
        self,
        tracker: GeneralTracker,
        policy: FailurePolicy,
        journal: JournalSettings | None = None,
    ) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.policy = policy
        self.failed = False
        self.started = False
        self.reference: dict[str, Any] | None = None
        self.planned: dict[str, Any] | None = None
        # Called on this worker's thread once start() returned (the hub moves its exit hook
        # behind the one the backend may have registered in start(): wandb does).
        self.on_started: Callable[[], None] | None = None
        self.opened = threading.Event()  # the first Start was handled (successfully or not)
        self._failed_lock = threading.Lock()
        self._degraded = False
        self.busy: str | None = None
        self.busy_since = 0.0
        self.items: collections.deque[Item] = collections.deque()
        self.wake = threading.Event()
        self.journal_settings = journal
        self.journal: Journal | None = None
        # Held while entries are numbered and written, and while the journal closes: the hub's
        # thread journals the queue itself when this thread hangs in a backend call (adopt).
        self._journal_lock = threading.RLock()
        self._hung_said = False  # kept_while_hung was said
        # Undelivered entries in order, with the live values (``None``: read from disk).
        self._pending: collections.deque[tuple[Entry, Any]] = collections.deque()
        self._on_disk = False  # undelivered entries exist on disk beyond those in memory
        self._retry_at = 0.0
        self._backoff = min(_FIRST_RETRY_S, _max_retry_s())
        self._outage: float | None = None  # when the backend stopped answering
        self._singly = 0  # entries to send one at a time (a batch holding a refused value)
        self._start_waiting = False  # start() failed with a transient error: retried
        self.thread = threading.Thread(
            target=self._run, name=f"accelkit-tracker-{self.name}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        items = self.items
        while True:
            self.wake.clear()
            while items:
                if self.journal is not None and type(items[0]) is tuple and not self.failed:
                    self._journal_logs(items)
                    continue
                if self._handle(items.popleft()):
                    return
            wait = POLL_S
            if self._start_waiting and time.monotonic() >= self._retry_at and self._try_start():
                self._deliver()  # what was journaled meanwhile; says it answers again
            if self._pending or self._on_disk or self._start_waiting:
                self._deliver()
                if self._retry_at:
                    wait = min(POLL_S, max(0.0005, self._retry_at - time.monotonic()))
            self.wake.wait(wait)

    # ------------------------------------------------------------------ the journal

    def _journal_logs(self, items: collections.deque[Item]) -> None:
        """Journal the ``Log`` requests at the head of the queue (one write), then send."""
        with self._journal_lock:
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
        self._deliver()

    def _record(self, batch: list[tuple[Entry, Any]]) -> None:
        with self._journal_lock:
            journal = self.journal
            if journal is None or not batch:
                return
            try:
                journal.write([entry for entry, _ in batch])
            except OSError as error:
                self._journal_broken(error)
            if self._on_disk or len(self._pending) + len(batch) > _MEMORY:
                self._on_disk = True
            else:
                self._pending.extend(batch)

    def adopt(self) -> int:
        """Journal the queue from the calling thread while this worker hangs in a backend call.

        Called by the hub when it gives up waiting for the worker (the queue outgrew
        ``max_pending`` behind a call that does not return, or ``finish`` ran out of time): the
        values and checkpoint events waiting in the queue are numbered and written to the
        journal in their order, so nothing queued is lost when the process ends. The worker
        sends them from the journal once its call returns (or ``accelkit track sync`` does).
        Control items (a flush mark, the stop) stay queued, in order.

        Returns:
            How many entries were journaled (0 without a journal or with nothing waiting).
        """
        with self._journal_lock:
            journal = self.journal
            if journal is None:
                return 0
            items = self.items
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
                elif isinstance(item, Checkpoint) and not self.failed:
                    event = item.event
                    where = {"kind": event.kind, "path": event.path, "iteration": event.iteration}
                    entry = journal.entry("event", event.step, dict(event.values), where)
                    batch.append((entry, event))
                else:
                    kept.append(item)
            for item in reversed(kept):
                items.appendleft(item)
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
        self.policy.journal_off(self.name, error)
        if journal is not None:
            try:
                journal.close()
            except OSError:
                pass

    def _deliver(self, *, force: bool = False) -> None:
        """Send undelivered entries in order until one fails; a backend that does not answer
        is tried again after a backoff (0.5 s, doubling up to ``ACCELKIT_TRACKER_RETRY_MAX_S``,
        30 by default).

        A tracker with its own ``log_batch`` receives runs of ``log`` entries (all that are
        waiting, up to ``_SEND_BATCH`` entries and its ``max_batch_values``) in one call, each
        run recorded as delivered when the call returns; the others receive one call per entry.
        """
        if self.failed or not self.started:
            return
        if not force and time.monotonic() < self._retry_at:
            return
        pending = self._pending
        tracker = self.tracker
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
                    tracker, [pending[i][0] for i in range(min(len(pending), _SEND_BATCH))]
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
        if self._outage is not None:
            self.policy.recovered(self.name, time.monotonic() - self._outage)
            self._outage = None
        self._backoff = min(_FIRST_RETRY_S, _max_retry_s())
        self._retry_at = 0.0

    def _drain(self) -> None:
        """At the end of the run, keep trying to deliver (and to start a backend whose
        ``start()`` is being retried), with the backoff, for at most the policy's ``drain``
        seconds (``ACCELKIT_TRACKER_DRAIN_S``, 10 by default, and half the tracker timeout);
        what is left stays journaled."""
        if not (self._pending or self._on_disk or self._start_waiting):
            return
        # Within the hub's wait for finish, so the run ends without a warning.
        deadline = time.monotonic() + self.policy.drain
        if self._start_waiting:
            self._try_start()
        self._deliver(force=True)
        while (
            (self._pending or self._on_disk or self._start_waiting)
            and not self.failed
            and (self.started or self._start_waiting)
        ):
            pause = max(0.0, self._retry_at - time.monotonic())
            if time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            if self._start_waiting:
                self._try_start()
            self._deliver()

    def _refill(self) -> None:
        with self._journal_lock:  # never half of an adoption's write
            journal = self.journal
            if journal is None:  # given up meanwhile (reported): nothing to read back
                self._on_disk = False
                return
            entries = journal.pending(limit=_MEMORY)
            self._pending.extend((entry, None) for entry in entries)
            if not entries or entries[-1].seq >= journal.next_seq - 1:
                self._on_disk = False

    def _send_logs(self, pending: collections.deque[tuple[Entry, Any]], journal: Journal) -> str:
        """Send the ``log`` entries at the head of ``pending`` with one ``log`` call each (a
        tracker without ``log_batch``), each marked as being sent before its call and as
        delivered right after: the worker's inner loop, kept lean (it runs once per value set
        and tracker, on a thread that shares the GIL with the training loop). Returns the
        outcome of the last call (``"ok"`` when a run of entries went out)."""
        log = self.tracker.log
        monotonic = time.monotonic
        outcome = "ok"
        try:
            sent = 0
            while pending and sent < _SEND_BATCH:
                entry, live = pending[0]
                if entry.kind != "log":
                    break
                journal.sending(entry.seq)
                self.busy = "log"
                self.busy_since = monotonic()
                try:
                    kwargs = entry.extra.get("kwargs") if entry.extra else None
                    values = live if live is not None else dict(entry.values)
                    if kwargs:
                        log(values, entry.step, **kwargs)
                    else:
                        log(values, entry.step)
                except Exception as error:
                    self.busy = None
                    outcome = self._failed_send(error, "log", [(entry, live)])
                    if outcome != "skip":
                        return outcome
                self.busy = None
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
        entry = group[0][0]
        method = {"log": "log", "config": "store_init_configuration"}.get(
            entry.kind, "on_checkpoint"
        )
        if batched and entry.kind == "log" and not entry.extra:
            method = "log_batch"
        self.busy = method
        self.busy_since = time.monotonic()
        try:
            if method == "log_batch":
                self.tracker.log_batch(
                    [
                        (live if live is not None else dict(e.values), e.step, e.time)
                        for e, live in group
                    ]
                )
            else:
                call(self.tracker, entry, group[0][1])
            return "ok"
        except Exception as error:
            return self._failed_send(error, method, group)
        finally:
            self.busy = None

    def _failed_send(self, error: Exception, method: str, group: list[tuple[Entry, Any]]) -> str:
        entry = group[0][0]
        if entry.kind == "event":
            self._degrade(f"on_checkpoint() failed ({type(error).__name__}: {error})")
            return "skip"
        verdict = classify(error)
        if verdict == "refused":
            if len(group) > 1:
                return "split"
            self.policy.refused(self.name, method, entry.seq, entry.step, error)
            return "skip"
        if verdict == "fatal":
            self.fail(method, error)
            return "fatal"
        self._retry_later(method, error)
        return "retry"

    def _retry_later(self, method: str, error: BaseException) -> None:
        """The backend did not answer: say so once per outage, try again after the backoff."""
        if self._outage is None:
            self._outage = time.monotonic()
            folder = self.journal.folder if self.journal is not None else None
            self.policy.retrying(self.name, method, error, folder)
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, _max_retry_s())

    def _open_journal(self, resume: Resume | None) -> None:
        settings = self.journal_settings
        if settings is None:
            return
        try:
            journal = Journal.open(settings.logging_dir, settings.name)
            if journal.next_seq or journal.problems:
                run = None if journal.problems else journal.read_run()
                if (
                    run is not None
                    and resume is not None
                    and _same_run(run.get("reference"), resume.reference)
                ):
                    journal.drop_after(resume.step)  # the resumed run logs those again
                    journal.load()
                else:  # a previous run's (for `accelkit track sync`) or a damaged one
                    journal.set_aside()
                    journal = Journal.open(settings.logging_dir, settings.name)
            self.journal = journal
            self._on_disk = journal.acked < journal.next_seq - 1
        except OSError as error:
            self._journal_broken(error)

    def _write_run(self) -> None:
        settings = self.journal_settings
        if self.journal is None or settings is None:
            return
        try:
            reference = self.reference if self.reference is not None else self.planned
            self.journal.write_run({**settings.run, "reference": reference})
        except OSError as error:
            self._journal_broken(error)

    def _handle(self, item: Item) -> bool:
        """Process one queued item; True once the tracker is finished."""
        if not isinstance(item, (Checkpoint, Start, Stop, Mark)):
            if not self.failed:
                values, step, kwargs, pending = item
                values = resolve(values) if pending else dict(values)
                self.call("log", self.tracker.log, values, step, **(kwargs or {}))
            return False
        if isinstance(item, Checkpoint):
            if not self.failed and (self.started or self._start_waiting):
                if self.journal is not None:
                    event = item.event
                    extra = {"kind": event.kind, "path": event.path, "iteration": event.iteration}
                    with self._journal_lock:
                        journal = self.journal
                        if journal is not None:
                            entry = journal.entry("event", event.step, dict(event.values), extra)
                            self._record([(entry, event)])
                    self._deliver()
                else:
                    self._checkpoint(item.event)
            return False
        if isinstance(item, Start):
            if not self.failed:
                self._open(item.config, item.resume)
            self.opened.set()
            item.done.set()
            return False
        if isinstance(item, Stop):
            self._drain()
            with self._journal_lock:  # after an adoption in flight has written its entries
                closing = self.journal
                if closing is not None:
                    left = closing.next_seq - 1 - closing.acked
                    if left > 0 and not self.failed:  # a failed tracker was reported already
                        self.policy.undelivered(self.name, left, closing.folder)
                    try:
                        closing.close()
                    except OSError:
                        pass
            # A backend that still does not answer is not asked to finish its run (its client
            # would retry past the end of the job): `accelkit track sync` finishes it.
            if not self.failed and self.started and self._outage is None:
                self.call("finish", self.tracker.finish)
            item.done.set()
            return True
        item.done.set()  # a Mark
        return False

    def _open(self, config: Mapping[str, Any] | None, resume: Resume | None) -> None:
        """Open the run: continue the checkpoint's run (``resume``), start, store the
        configuration, take the reference.

        With a journal, a ``start()`` that fails with an error retrying may fix (a server down,
        a refused connection: :func:`~accelkit.trackers.failures.classify`) is tried again
        with the backoff, the values being journaled meanwhile and sent once it returns; any
        other error fails the tracker (reported once).
        """
        tracker = self.tracker
        if self.journal_settings is not None:
            # Before any backend call: what is logged while one hangs (a client retrying a
            # server that is down) is journaled by the hub, in the run named here.
            self._open_journal(resume)
            self._write_run()
        if resume is not None and not self.call(
            "continue_run", tracker.continue_run, resume.reference, resume.step
        ):
            return
        if self.journal_settings is None:
            # Not failed again: a start() that returned after its time limit was reported.
            if not self.call("start", tracker.start) or self.failed:
                return
            self.started = True
            if config is not None:
                self.call("store_init_configuration", tracker.store_init_configuration, config)
            self._take_reference()
            return
        if self.journal is None:  # it could not be used (reported): no retrying without it
            if self.call("start", tracker.start) and not self.failed:
                self.started = True
                if config is not None:
                    self.call("store_init_configuration", tracker.store_init_configuration, config)
                self._take_reference()
            return
        self._try_start()
        if config is not None and self.journal is not None and not self.failed:
            with self._journal_lock:
                if self.journal is not None:
                    self._record([(self.journal.entry("config", -1, config), config)])
            self._deliver()

    def _try_start(self) -> bool:
        """Call ``start()``; True once the backend's run is open (its reference taken and
        recorded). A transient error schedules another try after the backoff; any other error
        fails the tracker."""
        self.busy = "start"
        self.busy_since = time.monotonic()
        try:
            self.tracker.start()
        except Exception as error:
            if classify(error) == "retry" and self.journal is not None:
                self._start_waiting = True
                self._retry_later("start", error)
            else:
                self._start_waiting = False
                self.fail("start", error)
            return False
        finally:
            self.busy = None
        self._start_waiting = False
        if self.failed:  # returned after its time limit: reported already
            return False
        self.started = True
        self._retry_at = 0.0
        self._take_reference()
        self._write_run()
        return True

    def _take_reference(self) -> None:
        """After a successful ``start()``: the run's reference, then ``on_started``."""
        if self.on_started is not None:
            try:
                self.on_started()
            except Exception:  # pragma: no cover - an exit hook's order is not worth a failure
                pass
        try:
            reference = self.tracker.run_reference()
            self.reference = None if reference is None else dict(reference)
        except Exception as error:
            self.reference = None
            self._degrade(f"run_reference() failed ({type(error).__name__}: {error})")

    def _checkpoint(self, event: CheckpointEvent) -> None:
        # A tracker that cannot record a checkpoint event still logs the run's values.
        try:
            self.tracker.on_checkpoint(event)
        except Exception as error:
            self._degrade(f"on_checkpoint() failed ({type(error).__name__}: {error})")

    def _degrade(self, what: str) -> None:
        if not self._degraded:
            self._degraded = True
            self.policy.degraded(self.name, what)

    def call(self, method: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run one tracker method; on an exception fail the tracker (see :meth:`fail`)."""
        self.busy = method
        self.busy_since = time.monotonic()
        try:
            function(*args, **kwargs)
            return True
        except Exception as error:
            self.fail(method, error)
            return False
        finally:
            self.busy = None

    def fail(self, method: str, error: BaseException) -> None:
        """Mark the tracker failed and report it to the policy, unless it already was (it timed
        out while in this call, say): a tracker is reported once."""
        if self.mark_failed():
            self.policy.report(TrackerFailure(self.name, method, error))

    def stuck(self) -> bool:
        """Whether the worker has been inside one backend call for longer than the policy's
        ``timeout``."""
        return self.policy.stuck(self.busy, self.busy_since)

    def overflow(self) -> None:
        """Its queue outgrew the policy's ``max_pending`` behind a backend call that does not
        return. With a journal, the values waiting are journaled from the calling thread
        (:meth:`adopt`) and sent once the backend answers, said once; without one, the tracker
        is skipped: the values waiting are dropped and the failure is reported."""
        journal = self.journal
        if journal is not None and self.adopt() and self.journal is not None:
            if not self._hung_said:
                self._hung_said = True
                self.policy.kept_while_hung(self.name, self.busy, journal.folder)
            return
        waiting = len(self.items)
        busy = self.busy
        if not self.mark_failed():
            return
        self.items.clear()
        self.policy.report(self.policy.overflowed(self.name, waiting, busy))

    def timed_out(self) -> None:
        """Skip this tracker: its run did not open within the policy's ``timeout``."""
        busy = self.busy or "start"
        if self.mark_failed():  # not when it failed (and was reported) just as the wait ended
            self.policy.report(self.policy.start_timed_out(self.name, busy))

    def mark_failed(self) -> bool:
        """Mark the tracker failed; True for the one caller that should report it."""
        with self._failed_lock:
            first, self.failed = not self.failed, True
        return first

    def signal(self, make: Callable[[threading.Event], Item]) -> threading.Event:
        """Queue the item ``make(done)`` and wake the worker; ``done`` is set once it is
        handled (``make`` is :class:`Mark`, :class:`Stop` or a partial :class:`Start`)."""
        done = threading.Event()
        self.items.append(make(done))
        self.wake.set()
        return done


def call(tracker: GeneralTracker, entry: Entry, live: Any = None) -> None:
    """Hand one journal entry to ``tracker`` (``live``: the values as logged, when the entry
    is being sent by the run that logged it; else the journaled plain values are sent)."""
    if entry.kind == "log":
        kwargs = entry.extra.get("kwargs") or {}
        values = live if live is not None else dict(entry.values)
        tracker.log(values, entry.step, **kwargs)
    elif entry.kind == "config":
        tracker.store_init_configuration(live if live is not None else dict(entry.values))
    else:
        event = live
        if not isinstance(event, CheckpointEvent):
            extra = entry.extra
            kind: Literal["save", "load"] = "load" if extra.get("kind") == "load" else "save"
            iteration = extra.get("iteration")
            event = CheckpointEvent(
                kind,
                entry.step,
                str(extra.get("path", "")),
                iteration if type(iteration) is int else None,
                {
                    str(k): float(v)
                    for k, v in entry.values.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                },
            )
        tracker.on_checkpoint(event)


def has_log_batch(tracker: GeneralTracker) -> bool:
    """Whether ``tracker`` has a ``log_batch`` of its own (else the worker calls ``log`` once
    per entry, recording each as delivered: the default ``log_batch`` could not say how far it
    got when one of its calls fails)."""
    return type(tracker).log_batch is not GeneralTracker.log_batch


def batch_length(tracker: GeneralTracker, entries: list[Entry]) -> int:
    """How many of ``entries`` (the next to send, in order) go in one ``log_batch`` call:
    the ``log`` entries without keyword arguments at their head, at most ``_SEND_BATCH`` and
    the tracker's ``max_batch_values`` values (an entry with more goes alone); ``1`` when
    the first is not such an entry (it is sent with its own method)."""
    limit = tracker.max_batch_values
    total = 0
    count = 0
    for entry in entries:
        if entry.kind != "log" or entry.extra:
            break
        weight = 0
        for value in entry.values.values():
            weight += len(value) if type(value) is dict else 1
        total += weight
        if count and total > limit:
            break
        count += 1
    return max(count, 1)


def settle(tracker: GeneralTracker, journal: Journal, entries: list[Entry]) -> int:
    """Settle the entries a killed sender left *in doubt* (``entries``: those after ``acked``
    up to :attr:`Journal.in_doubt`, in order): returns how many of them the backend has
    already; they are recorded as delivered and not sent again.

    They were sent in order, so the backend holds a first part of them: a tracker that can
    tell defines ``journal_delivered(step, values) -> bool`` (MLflow does), asked about as few
    entries as a bisection needs. For one that cannot, they are sent again, with a warning:
    a killed sender's one entry (or, for a tracker with ``log_batch``, its one batch) may then
    reach the backend twice.
    """
    journal.in_doubt = None
    if not entries:
        return 0
    probe = getattr(tracker, "journal_delivered", None)
    if probe is None:
        what = (
            f"journal entry {entries[0].seq} (step {entries[0].step}) was"
            if len(entries) == 1
            else f"journal entries {entries[0].seq}-{entries[-1].seq} (steps "
            f"{entries[0].step}-{entries[-1].step}) were"
        )
        warnings.warn(
            f"Tracker {tracker.name!r}: {what} being sent when the last sender stopped, and "
            "this tracker cannot tell whether its backend took them (it has no "
            "journal_delivered method); they are sent again and may appear twice.",
            JournalWarning,
            stacklevel=2,
        )
        return 0

    def delivered(entry: Entry) -> bool:
        try:
            return bool(probe(entry.step, dict(entry.values)))
        except Exception:
            return False

    low, high = 0, len(entries)  # the backend has the first `low`, not all past `high`
    while low < high:
        middle = (low + high + 1) // 2
        if delivered(entries[middle - 1]):
            low = middle
        else:
            high = middle - 1
    if low:
        journal.ack(entries[low - 1].seq)
    return low


def deliver(tracker: GeneralTracker, journal: Journal, on_sent: Callable[[Entry], None]) -> int:
    """Send every undelivered entry of ``journal`` to a started ``tracker``, in order
    (in batches to a tracker with ``log_batch``), recording each call's entries as delivered
    right after the tracker accepts them (``accelkit track sync``).

    Returns:
        How many were sent.

    Raises:
        Exception: the tracker's error; the entries before it stay delivered.
    """
    sent = 0
    batched = has_log_batch(tracker)
    while True:
        entries = journal.pending(limit=_MEMORY)
        if not entries:
            return sent
        if journal.in_doubt is not None:
            doubt = journal.in_doubt
            settle(tracker, journal, [entry for entry in entries if entry.seq <= doubt])
            continue
        at = 0
        while at < len(entries):
            count = batch_length(tracker, entries[at : at + _SEND_BATCH]) if batched else 1
            group = entries[at : at + count]
            journal.sending(group[-1].seq)
            if batched and group[0].kind == "log" and not group[0].extra:
                tracker.log_batch([(dict(e.values), e.step, e.time) for e in group])
            else:
                call(tracker, group[0])
            journal.ack(group[-1].seq)
            at += count
            sent += count
            for entry in group:
                on_sent(entry)


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
