"""One tracker, its queue and the daemon thread that feeds it (the hub's building block).

The queue holds one typed item per request, handled in order: :class:`Log` (values at a step),
:class:`Mark` (set an event once everything before it is done: flush), :class:`Stop` (finish the
tracker), :class:`Start` (open the run: continue a checkpoint's run if one was loaded, start,
store the configuration) and :class:`Checkpoint` (a
:class:`~accelkit.trackers.events.CheckpointEvent`). What a failure or a hang costs is the
:class:`~accelkit.trackers.failures.FailurePolicy`'s decision, which the worker receives.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.failures import FailurePolicy, TrackerFailure
from accelkit.trackers.values import resolve

__all__ = ["Checkpoint", "Item", "Log", "Mark", "Resume", "Start", "Stop", "Worker"]

POLL_S = 0.05


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
        opened: set once the worker handled its start (successfully or not).
    """

    def __init__(self, tracker: GeneralTracker, policy: FailurePolicy) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.policy = policy
        self.failed = False
        self.started = False
        self.reference: dict[str, Any] | None = None
        self.opened = threading.Event()  # the first Start was handled (successfully or not)
        self._failed_lock = threading.Lock()
        self._degraded = False
        self.busy: str | None = None
        self.busy_since = 0.0
        self.items: collections.deque[Item] = collections.deque()
        self.wake = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"accelkit-tracker-{self.name}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        items = self.items
        while True:
            self.wake.clear()
            while items:
                if self._handle(items.popleft()):
                    return
            self.wake.wait(POLL_S)

    def _handle(self, item: Item) -> bool:
        """Process one queued item; True once the tracker is finished."""
        if not isinstance(item, (Checkpoint, Start, Stop, Mark)):
            if not self.failed:
                values, step, kwargs, pending = item
                values = resolve(values) if pending else dict(values)
                self.call("log", self.tracker.log, values, step, **(kwargs or {}))
            return False
        if isinstance(item, Checkpoint):
            if not self.failed and self.started:
                self._checkpoint(item.event)
            return False
        if isinstance(item, Start):
            if not self.failed:
                self._open(item.config, item.resume)
            self.opened.set()
            item.done.set()
            return False
        if isinstance(item, Stop):
            if not self.failed and self.started:
                self.call("finish", self.tracker.finish)
            item.done.set()
            return True
        item.done.set()  # a Mark
        return False

    def _open(self, config: Mapping[str, Any] | None, resume: Resume | None) -> None:
        """Open the run: continue the checkpoint's run (``resume``), start, store the
        configuration, take the reference."""
        tracker = self.tracker
        if resume is not None and not self.call(
            "continue_run", tracker.continue_run, resume.reference, resume.step
        ):
            return
        # Not failed again: a start() that returned after its time limit was reported.
        if not self.call("start", tracker.start) or self.failed:
            return
        self.started = True
        if config is not None:
            self.call("store_init_configuration", tracker.store_init_configuration, config)
        try:
            reference = tracker.run_reference()
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
        """Skip this tracker: its queue outgrew the policy's ``max_pending`` (its backend is
        hung); the values waiting are dropped and the failure is reported."""
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
