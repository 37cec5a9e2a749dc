"""The hub's bounded waits for its workers: a run's opening, a flush, the end of the run.

No wait is unbounded. A worker that does not answer in time is reported; what waits in its
queue is journaled from the waiting thread (:meth:`Worker.adopt
<accelkit.trackers.delivery.worker.Worker.adopt>`), so that the end of the process loses none
of it, or, with nowhere to keep its values, the tracker is skipped.
"""

from __future__ import annotations

import threading
import time

from accelkit.delivery.drain import Deadline
from accelkit.trackers.delivery.failures import FailurePolicy
from accelkit.trackers.delivery.items import Mark, Stop
from accelkit.trackers.delivery.worker import POLL_S, Worker

__all__ = ["wait_for", "wait_given_up", "wait_opened", "wait_started"]


def wait_started(worker: Worker, done: threading.Event, policy: FailurePolicy) -> None:
    """Wait at most the policy's ``timeout`` for ``worker`` to open its run (``done``). One
    that does not is skipped (reported) without a journal; with one, what waits in its queue
    is journaled from this thread, and it is not skipped (said once)."""
    if done.wait(policy.timeout):
        return
    journal = worker.outbox.journal
    if journal is None:  # nowhere to keep its values while it hangs: skipped
        worker.session.timed_out()
        return
    # Its values go to its journal meanwhile (sent once start() returns, or by
    # `accelkit track sync`): not skipped.
    worker.adopt()
    policy.late(worker.name, "open its run", policy.timeout, worker.session.busy, journal.folder)


def wait_given_up(
    given_up: list[tuple[Worker, threading.Event]], timeout: float, policy: FailurePolicy
) -> None:
    """Wait (at most ``timeout`` seconds in all) for workers giving up their runs (each
    ``done``); one that is late is said once and not waited for (its next opening is queued
    behind, so it still continues the checkpoint's run when it answers)."""
    deadline = Deadline(timeout)
    for worker, done in given_up:
        if not done.wait(deadline.left()):
            policy.late(
                worker.name, "give its run up for the checkpoint's", timeout, worker.session.busy
            )


def wait_opened(workers: list[Worker], timeout: float) -> None:
    """Wait (at most ``timeout`` seconds in all) for runs whose opening is queued."""
    deadline = Deadline(timeout)
    for worker in [worker for worker in workers if not worker.session.opened.is_set()]:
        worker.session.opened.wait(deadline.left())


def wait_for(
    workers: list[Worker],
    kind: type[Mark] | type[Stop],
    limit: float,
    policy: FailurePolicy,
    what: str,
) -> bool:
    """Queue ``kind`` (a flush mark, or the stop) on each worker and wait for them, at most
    ``limit`` seconds in all; True if every one was handled in time.

    At the end of the run (``Stop``), a journaled worker hung in a backend call is waited
    for the policy's ``drain`` time only. A worker that is late is reported (``what`` names
    the wait): what waits in its queue is journaled from this thread, or, hung while opening
    its run without a journal, it is skipped.
    """
    # A tracker already reported failed while stuck in a backend call is not waited for
    # (nor reported a second time).
    events = [
        (worker, worker.signal(kind))
        for worker in workers
        if worker.thread.is_alive() and not (worker.session.failed and worker.session.busy)
    ]
    deadline = Deadline(limit)
    # At the end of the run, a journaled tracker whose backend does not answer (a start()
    # or a delivery call that has not returned: a client retrying a server that is down)
    # is waited for the drain time only: what it holds is journaled below.
    drain = Deadline(policy.drain) if kind is Stop else deadline
    hung = max(policy.drain, _HUNG_CALL_S)
    done = True
    for worker, event in events:
        late = _wait_stop(worker, event, deadline, drain, hung)
        if not late:
            continue
        done = False
        if worker.outbox.journal is None and not worker.session.opened.is_set():
            # hung while opening its run, with nowhere to keep values
            worker.session.timed_out()
            continue
        # Hung in a backend call: what waits behind it goes to its journal now (from
        # this thread), so that the end of the process loses none of it.
        worker.adopt()
        journal = worker.outbox.journal  # None if it could not be written (reported)
        kept = journal.folder if journal is not None else None
        if late == "drain":
            policy.late(
                worker.name,
                what,
                policy.drain,
                worker.session.busy,
                kept,
                setting="ACCELKIT_TRACKER_DRAIN_S",
            )
        else:
            policy.late(worker.name, what, limit, worker.session.busy, kept)
    return done


# The least time one backend call must have run, at the end of the run's drain time, to be
# taken for a client retrying a server that does not answer rather than a slow answer (the
# drain time itself when it is longer).
_HUNG_CALL_S = 2.0


def _wait_stop(
    worker: Worker, event: threading.Event, deadline: Deadline, drain: Deadline, hung: float
) -> str:
    """Wait for ``event``: ``""`` once it is set, else the limit that ran out: ``"deadline"``,
    or ``"drain"`` for a journaled worker that, past ``drain``, has been in one backend call
    for ``hung`` seconds or more (a call that answers sooner, or the tracker's own
    ``finish()``, is waited for until ``deadline``)."""
    check = deadline.within(drain.left())
    while not event.wait(check):
        if deadline.expired():
            return "deadline"
        busy = worker.session.busy
        if (
            worker.outbox.journal is not None
            and busy not in (None, "finish")
            and time.monotonic() - worker.session.busy_since >= hung
        ):
            return "drain"
        check = deadline.within(POLL_S)  # answering, idle or finishing: look again shortly
    return ""
