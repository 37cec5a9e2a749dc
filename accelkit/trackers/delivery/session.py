"""One tracker's calls and the state of its run: `TrackerSession`.

Every backend call a worker makes goes through here (:meth:`TrackerSession.call`), so the hub
can see which call is running and since when (a hang), and a failure is reported once; so does
``start()`` (:meth:`TrackerSession.start`: tried again with the
:class:`~accelkit.delivery.retry.Backoff` while it fails with an error retrying may
fix, when a journal keeps the values meanwhile), and the run's reference is taken after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from accelkit.delivery.failures import HARD, REFUSED
from accelkit.delivery.retry import Backoff
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.delivery.failures import (
    FailurePolicy,
    TrackerFailure,
    classify,
    retry_policy,
)
from accelkit.trackers.events import CheckpointEvent

__all__ = ["TrackerSession"]


class TrackerSession:
    """A tracker, the state of its run, and every call made to it.

    Args:
        tracker: the tracker.
        policy: what a failure or a hang costs (shared by the run's trackers).

    Attributes:
        started: ``start()`` returned (the backend's run is open).
        failed: the tracker failed (reported once) and is skipped.
        reference: what the tracker's ``run_reference()`` returned after its start.
        planned: the reference of the run it is opening, known before its start (set by the
            hub: the tracker's ``name_run()``, or the checkpoint's reference it continues).
        opened: set once the worker handled its start (successfully or not).
        busy: the tracker method being called (``None``: none), since ``busy_since``.
        start_waiting: ``start()`` failed with a transient error and is tried again.
        backoff: when to try a backend that does not answer again (start and deliveries).
    """

    def __init__(self, tracker: GeneralTracker, policy: FailurePolicy) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.policy = policy
        self.failed = False
        self.started = False
        self.reference: dict[str, Any] | None = None
        self.planned: dict[str, Any] | None = None
        # Called on the worker's thread once start() returned (the hub moves its exit hook
        # behind the one the backend may have registered in start(): wandb does).
        self.on_started: Callable[[], None] | None = None
        self.opened = threading.Event()  # the first Start was handled (successfully or not)
        self.busy: str | None = None
        self.busy_since = 0.0
        self.start_waiting = False  # start() failed with a transient error: retried
        self.backoff = Backoff(lambda: retry_policy(policy.retry_max))
        self._failed_lock = threading.Lock()
        self._degraded = False

    # ------------------------------------------------------------------ opening the run

    def start(self, *, retry: bool, journal: str | None = None) -> bool:
        """Call ``start()``; True once the backend's run is open (the caller then takes its
        reference: :meth:`take_reference`).

        Args:
            retry: a journal keeps the values meanwhile, so an error retrying may fix (a server
                down, a refused connection:
                :func:`~accelkit.trackers.delivery.failures.classify`) schedules another try
                after the backoff (:attr:`start_waiting`); without it, or for any other error,
                the tracker fails (reported once).
            journal: the journal's folder, for the message that says it is retried.
        """
        self.busy = "start"
        self.busy_since = time.monotonic()
        try:
            self.tracker.start()
        except Exception as error:
            if retry and classify(error) not in (HARD, REFUSED):
                self.start_waiting = True
                self.retry_later("start", error, journal)
            else:
                self.start_waiting = False
                self.fail("start", error)
            return False
        finally:
            self.busy = None
        self.start_waiting = False
        if self.failed:  # returned after its time limit: reported already
            return False
        self.started = True
        self.backoff.retry_at = 0.0
        return True

    def take_reference(self) -> None:
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
            self.degrade(f"run_reference() failed ({type(error).__name__}: {error})")

    def give_up(self) -> None:
        """Give up the open run for a checkpoint's: ``finish()`` it, then ``discard_run()``
        (a run that is kept is said once, by name), and forget it; the next :meth:`start`
        opens the checkpoint's run. Nothing is called on a run that never opened (its start
        still retried)."""
        self.start_waiting = False
        self.backoff.retry_at = 0.0
        if not self.started:
            return
        reference = self.reference
        self.started = False
        self.reference = None
        if not self.call("finish", self.tracker.finish):
            return
        self.busy = "discard_run"
        self.busy_since = time.monotonic()
        try:
            gone = bool(self.tracker.discard_run())
        except Exception as error:
            gone = False
            self.policy.left_behind(self.name, reference, f"{type(error).__name__}: {error}")
            return
        finally:
            self.busy = None
        if not gone:
            self.policy.left_behind(self.name, reference, None)

    # ------------------------------------------------------------------ calls and failures

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

    def checkpoint(self, event: CheckpointEvent) -> None:
        """Hand ``event`` to ``on_checkpoint`` (without a journal)."""
        # A tracker that cannot record a checkpoint event still logs the run's values.
        try:
            self.tracker.on_checkpoint(event)
        except Exception as error:
            self.degrade(f"on_checkpoint() failed ({type(error).__name__}: {error})")

    def degrade(self, what: str) -> None:
        """Say once that part of the tracker (not its values) does not work."""
        if not self._degraded:
            self._degraded = True
            self.policy.degraded(self.name, what)

    def retry_later(self, method: str, error: BaseException, journal: str | None) -> None:
        """The backend did not answer: say so once per outage, try again after the backoff."""
        if self.backoff.failed():
            self.policy.retrying(self.name, method, error, journal)

    def fail(self, method: str, error: BaseException) -> None:
        """Mark the tracker failed and report it to the policy, unless it already was (it timed
        out while in this call, say): a tracker is reported once."""
        if self.mark_failed():
            self.policy.report(TrackerFailure(self.name, method, error))

    def mark_failed(self) -> bool:
        """Mark the tracker failed; True for the one caller that should report it."""
        with self._failed_lock:
            first, self.failed = not self.failed, True
        return first

    def stuck(self) -> bool:
        """Whether the tracker has been inside one backend call for longer than the policy's
        ``timeout``."""
        return self.policy.stuck(self.busy, self.busy_since)

    def timed_out(self) -> None:
        """Skip this tracker: its run did not open within the policy's ``timeout``."""
        busy = self.busy or "start"
        if self.mark_failed():  # not when it failed (and was reported) just as the wait ended
            self.policy.report(self.policy.start_timed_out(self.name, busy))
