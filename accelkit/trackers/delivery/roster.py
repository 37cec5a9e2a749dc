"""Which of the hub's workers are fed, and when each opens its run: `Roster`.

A tracker's worker is made when the tracker is built (``init``), but its run may open later:
with ``defer_start`` the hub queues a tracker's ``start()`` at the run's first use, so that a
checkpoint loaded after ``init_trackers`` is still continued (see "Continuing runs" in
:mod:`~accelkit.trackers.delivery.hub`). The roster keeps the three lists that decision moves
workers between (every worker, those whose start is not queued yet, the live ones that
``log()`` feeds), queues each worker's opening (its start, the run configuration, the events
kept from before), and takes a failed tracker off the live list.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.delivery.failures import FailurePolicy
from accelkit.trackers.delivery.items import Checkpoint, GiveUp
from accelkit.trackers.delivery.runs import RunPlan
from accelkit.trackers.delivery.waits import wait_given_up, wait_started
from accelkit.trackers.delivery.worker import Worker
from accelkit.trackers.events import CheckpointEvent

__all__ = ["Roster"]


class Roster:
    """The workers of one run's trackers and the opening of their runs.

    Args:
        runs: the hub's run plan (what each opening continues, the events kept until then).
        policy: the hub's failure policy (a start that does not return in time is reported).

    Attributes:
        workers: every tracker's worker, in the order they were built, failed ones included.
        live: the workers ``log()`` feeds: their start was queued and they have not failed.
        unstarted: the workers whose start is not queued yet (``defer_start``).
        config: the run configuration each opening stores (again, when a run is reopened).
    """

    def __init__(self, runs: RunPlan, policy: FailurePolicy) -> None:
        self.workers: list[Worker] = []
        self.live: list[Worker] = []
        self.unstarted: list[Worker] = []
        self.config: Mapping[str, Any] | None = None
        # The instances started by init that continue runs (a later load gives theirs up).
        self.opened_at_init: list[Worker] = []
        self._runs = runs
        self._policy = policy
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Without workers, configuration or lock: they belong to the process that started
        them (see ``TrackerHub.__getstate__``)."""
        state = self.__dict__.copy()
        state.update(workers=[], live=[], unstarted=[], opened_at_init=[], config=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def named(self) -> bool:
        """Whether some tracker's opening was queued (its run is named from then on)."""
        return any(w not in self.unstarted for w in self.workers)

    def add(self, worker: Worker) -> None:
        """A built tracker's worker; its run opens at :meth:`open`."""
        self.workers.append(worker)
        self.unstarted.append(worker)

    def open(self, wait: bool, only: Sequence[Worker] | None = None) -> None:
        """Queue ``start`` (after ``continue_run`` when a checkpoint was loaded) and
        ``store_init_configuration`` for every tracker not started yet (or those of ``only``);
        with ``wait``, wait at most the policy's ``timeout`` seconds for each (a tracker that
        takes longer is reported and skipped)."""
        with self._lock:
            if only is None:
                workers, self.unstarted = self.unstarted, []
            else:
                workers = [w for w in self.unstarted if w in only]
                self.unstarted = [w for w in self.unstarted if w not in only]
            if not workers:
                return
            opened = []
            config = self.config
            for worker in workers:
                start = self._runs.opening(worker, config, self._policy)
                opened.append((worker, worker.signal(start)))
                for event in self._runs.early:
                    worker.put(Checkpoint(event))
            if not self.unstarted:
                self._runs.early = []
            self.live = self.live + [worker for worker in workers if not worker.session.failed]
        if wait:
            for worker, done in opened:
                wait_started(worker, done, self._policy)

    def open_deferred(self, given: Sequence[GeneralTracker | type[GeneralTracker]]) -> None:
        """The openings ``init`` queues with ``defer_start``; ``given``: what ``log_with``
        named, instances included.

        A tracker instance given to ``log_with`` is started here, as Accelerate does, since
        its owner may call its methods right after ``init_trackers`` (continuing the
        checkpoint's run when one was loaded already; a ``load_state`` afterwards gives its
        run up for the checkpoint's: :meth:`give_up`). The trackers ``log_with`` named are
        started in the background: at once when a checkpoint was loaded already, else at
        their first use, so that a ``load_state`` after ``init_trackers`` continues their
        runs without any run opened before it.
        """
        instances = [w for w in self.unstarted if any(w.tracker is s for s in given)]
        if instances:
            self.open(wait=True, only=instances)
            if self._runs.resume is None:  # new runs, which a later load gives up
                self.opened_at_init = [w for w in instances if _continues_runs(w.tracker)]
        if self._runs.resume is not None:
            self.open(wait=False)

    def give_up(self, timeout: float) -> list[Worker]:
        """Give up the runs the tracker instances opened at ``init`` (:meth:`open_deferred`)
        for a loaded checkpoint's, before anything was logged: each live one finishes its run
        and discards it (``GiveUp``) and waits, at most ``timeout`` seconds in all, and is
        unstarted again, so that its next opening continues the checkpoint's run. Trackers
        that do not continue runs keep theirs.

        Returns:
            The workers given up (their openings are the caller's to queue).
        """
        with self._lock:
            workers = [w for w in self.opened_at_init if w in self.live]
            self.opened_at_init = []
            if not workers:
                return []
            self.live = [w for w in self.live if w not in workers]
            self.unstarted = self.unstarted + workers
        wait_given_up([(w, w.signal(GiveUp)) for w in workers], timeout, self._policy)
        return [w for w in workers if not w.session.failed]

    def drop_failed(self) -> None:
        """Stop feeding failed trackers (the policy's ``on_skip``)."""
        with self._lock:
            self.live = [w for w in self.live if not w.session.failed]

    def take(self) -> list[Worker]:
        """Every worker, handed over at the end of the run (the roster is empty after)."""
        workers, self.workers, self.live = self.workers, [], []
        self.opened_at_init = []
        return workers

    def deliver(self, event: CheckpointEvent, expected: bool) -> None:
        """Queue ``event`` for every live tracker; before the runs open (or, with
        ``expected`` trackers, before any was built) it is kept for their opening."""
        with self._lock:
            live = self.live
            if self.unstarted or (not live and expected):
                self._runs.keep(event)
        for worker in live:
            worker.put(Checkpoint(event))


def _continues_runs(tracker: GeneralTracker) -> bool:
    """Whether ``tracker`` continues a checkpoint's run (its own ``continue_run``)."""
    return type(tracker).continue_run is not GeneralTracker.continue_run
