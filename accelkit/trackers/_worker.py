"""One tracker, its queue and the daemon thread that feeds it (the hub's building block).

Items are tuples whose first element is a kind: ``LOG`` (values at a step), ``MARK`` (set an
event once everything before it is done: flush), ``STOP`` (finish the tracker), ``START``
(open the run: continue a checkpoint's run if one was loaded, start, store the
configuration) and ``EVENT`` (a :class:`~accelkit.trackers.events.CheckpointEvent`).
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.failures import TrackerFailure
from accelkit.trackers.values import resolve

if TYPE_CHECKING:
    from accelkit.trackers.hub import TrackerHub

__all__ = ["EVENT", "LOG", "MARK", "START", "STOP", "Resume", "Worker"]

LOG, MARK, STOP, START, EVENT = 0, 1, 2, 3, 4
POLL_S = 0.05

Resume = tuple[dict[str, Any] | None, int]
"""What ``continue_run`` receives: the checkpoint's reference for the tracker, and its step."""


class Worker:
    """A tracker, its queue and the daemon thread that feeds it.

    ``log`` only appends to a deque (no lock, no system call): waking a sleeping thread on
    every call would cost the caller a futex wake-up, several microseconds on a busy machine.
    The worker instead drains the deque every ``POLL_S`` seconds, or at once when the queue
    grows past the hub's wake-up size or a flush/finish asks for it.

    Attributes:
        started: ``start()`` returned (the backend's run is open).
        reference: what the tracker's ``run_reference()`` returned after its start.
        opened: set once the worker handled its start (successfully or not).
    """

    def __init__(self, tracker: GeneralTracker, hub: TrackerHub) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.failed = False
        self.started = False
        self.reference: dict[str, Any] | None = None
        self.opened = threading.Event()  # the first START was handled (successfully or not)
        self._failed_lock = threading.Lock()
        self._event_warned = False
        self.busy: str | None = None
        self.busy_since = 0.0
        self.items: collections.deque[tuple[Any, ...]] = collections.deque()
        self.wake = threading.Event()
        self._hub = weakref.ref(hub)
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

    def _handle(self, item: tuple[Any, ...]) -> bool:
        """Process one queued item; True once the tracker is finished."""
        kind = item[0]
        if kind == LOG:
            if not self.failed:
                _, values, step, kwargs, pending = item
                values = resolve(values) if pending else dict(values)
                self.call("log", self.tracker.log, values, step, **(kwargs or {}))
            return False
        if kind == EVENT:
            if not self.failed and self.started:
                self._event(item[1])
            return False
        if kind == START:
            _, done, config, resume = item
            if not self.failed:
                self._open(config, resume)
            self.opened.set()
            done.set()
            return False
        if kind == STOP and not self.failed and self.started:
            self.call("finish", self.tracker.finish)
        item[1].set()
        return kind == STOP

    def _open(self, config: Any, resume: Resume | None) -> None:
        """Open the run: continue the checkpoint's run (``resume``), start, store the
        configuration, take the reference."""
        tracker = self.tracker
        if resume is not None and not self.call("continue_run", tracker.continue_run, *resume):
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
            self._warn(f"run_reference() failed ({type(error).__name__}: {error})")

    def _event(self, event: Any) -> None:
        # A tracker that cannot record a checkpoint event still logs the run's values.
        try:
            self.tracker.on_checkpoint(event)
        except Exception as error:
            self._warn(f"on_checkpoint() failed ({type(error).__name__}: {error})")

    def _warn(self, what: str) -> None:
        if self._event_warned:
            return
        self._event_warned = True
        warnings.warn(
            f"Tracker {self.name!r}: {what}; its checkpoint records are skipped, its values "
            "are still logged.",
            UserWarning,
            stacklevel=1,
        )

    def call(self, method: str, function: Any, *args: Any, **kwargs: Any) -> bool:
        """Run one tracker method; on an exception mark the tracker failed and report it."""
        self.busy = method
        self.busy_since = time.monotonic()
        try:
            function(*args, **kwargs)
            return True
        except Exception as error:
            # A tracker already reported (timed out while in this call) is not reported twice.
            hub = self._hub()
            if self.mark_failed() and hub is not None:
                hub._report(TrackerFailure(self.name, method, error))
            return False
        finally:
            self.busy = None

    def stuck(self, timeout: float) -> bool:
        """Whether the worker has been inside one backend call for longer than ``timeout``."""
        return self.busy is not None and time.monotonic() - self.busy_since > timeout

    def overflow(self) -> None:
        """Skip this tracker: its queue outgrew the hub's ``max_pending`` (its backend is
        hung); the values waiting are dropped and the failure is reported."""
        waiting = len(self.items)
        if not self.mark_failed():
            return
        self.items.clear()
        busy = f"busy in {self.busy}()" if self.busy else "not draining its queue"
        error = TimeoutError(
            f"{waiting} values waiting ({busy}): the backend is hung or far slower than the "
            "training loop. Raise ACCELKIT_TRACKER_MAX_PENDING if it is only slow"
        )
        hub = self._hub()
        if hub is not None:
            hub._report(TrackerFailure(self.name, "log", error))

    def mark_failed(self) -> bool:
        """Mark the tracker failed; True for the one caller that should report it."""
        with self._failed_lock:
            first, self.failed = not self.failed, True
        return first

    def signal(self, kind: int, *extra: Any) -> threading.Event:
        """Queue an item of ``kind`` and wake the worker; the event is set once it is done."""
        event = threading.Event()
        self.items.append((kind, event, *extra))
        self.wake.set()
        return event
