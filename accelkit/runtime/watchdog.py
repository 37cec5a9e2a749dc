"""The hang watchdog: a thread per process that notices when the training loop stops making step
progress, writes every thread's Python stack, tells the other processes, and ends the process
with an exit code a requeue script retries.

A hang (a rank stuck in a collective, a data loader that never yields, a deadlocked call) does
not raise: without a watchdog it burns the allocation until the collective's timeout (30
minutes by default), with nothing said about where it stopped. Here:

* **Progress** is counted, not timed: the step boundaries (:mod:`accelkit.training.boundary`:
  a prepared optimizer's ``step()``, a prepared dataloader asked for a batch) call
  :meth:`Watchdog.beat`, one integer increment. The watchdog's thread wakes every
  :attr:`Watchdog.poll_seconds` and notes when the count last changed; no clock is read on the
  training thread.
* **Not a hang**: inside :meth:`Watchdog.not_a_hang` (a long evaluation, the first compile, a
  slow save) the clock does not run; it starts afresh when the block ends. Before the first
  step boundary the clock does not run either (model loading, dataset preparation).
* **On a hang** (no beat for ``timeout_seconds``, or another process reported one through the
  process group's store): the process writes its stack file (:func:`faulthandler.dump_traceback`
  of every thread), marks the store so the other processes write theirs at once, runs its
  ``on_hang`` callback (the accelerator logs a tracker event and leaves a record for
  ``accelkit launch``), waits up to :attr:`Watchdog.grace_seconds` for every process to have
  done the same (so that the launcher, which stops the others once one exits, stops none before
  it wrote its stack), and exits with ``exit_code`` (75 by default, ``EX_TEMPFAIL``).

The process exits with :func:`os._exit`: its main thread is the one that hangs, so no exception
can reach the script, and no ``atexit`` code (which would wait on that thread's collectives)
may run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from accelkit._text import short
from accelkit.errors import ConfigurationError
from accelkit.runtime.trail import describe

__all__ = ["HANG_KEY", "HangReport", "Watchdog", "check_hang_timeout", "stack_file"]

logger = logging.getLogger("accelkit.watchdog")

#: The store key (under the process group's prefix) a process sets when it detects a hang.
HANG_KEY = "accelkit/watchdog/hang"
_DONE_KEY = "accelkit/watchdog/done"


def check_hang_timeout(value: object) -> float | None:
    """``hang_timeout_seconds`` as a float (``None``: no watchdog).

    Raises:
        ConfigurationError: naming the value when it is not a number of seconds above zero.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(
            f"hang_timeout_seconds={short(value)}: expected a number of seconds above 0 (how "
            "long a process may go without a step boundary before it counts as hung), or None "
            "for no watchdog; e.g. hang_timeout_seconds=600."
        )
    if value == float("inf"):
        return None
    return float(value)


def stack_file(folder: str, rank: int) -> str:
    """Where process ``rank`` writes its stacks under ``folder``."""
    return os.path.join(folder, f"hang-stacks-rank{rank}.txt")


@dataclass(frozen=True)
class HangReport:
    """A detected hang, as one process saw it.

    Attributes:
        rank: this process's rank.
        host: this machine's name.
        detected_by: the rank that saw no progress first (this one, or the one whose report
            reached it through the store).
        stalled_seconds: how long this process had gone without a step boundary.
        steps: step boundaries this process had passed.
        stack_file: this process's stack file.
        stack_folder: the folder of every process's stack file.
    """

    rank: int
    host: str
    detected_by: int
    stalled_seconds: float
    steps: int
    stack_file: str
    stack_folder: str


class Watchdog:
    """No step progress for ``timeout_seconds``: stacks, a report, and an exit (see the module's
    docstring).

    Args:
        timeout_seconds: how long without a step boundary counts as a hang.
        rank: this process's rank.
        world_size: the number of processes.
        stack_folder: where each process writes its stack file (created when needed).
        on_hang: called in the watchdog's thread once the stack file is written (its failure is
            logged, never raised).
        store: the process group's store (``None``: on one process, or none to use): how a
            hang seen by one process reaches the others without a collective.
        exit_code: the exit status of a hung process.
        grace_seconds: how long a hung process waits for the others' stacks before it exits.
        exit: how the process ends (tests give their own).
    """

    def __init__(
        self,
        timeout_seconds: float,
        *,
        rank: int,
        world_size: int,
        stack_folder: str,
        on_hang: Callable[[HangReport], None] | None = None,
        store: Any = None,
        exit_code: int = 75,
        grace_seconds: float = 10.0,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.rank = rank
        self.world_size = world_size
        self.stack_folder = stack_folder
        self.on_hang = on_hang
        self.store = store
        self.exit_code = exit_code
        self.grace_seconds = grace_seconds
        self._exit = exit
        #: Seconds between two looks of the thread (a hang is seen within timeout + this).
        self.poll_seconds = min(1.0, max(0.05, timeout_seconds / 10))
        self.beats = 0  # step boundaries passed: the only thing the training thread touches
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: HangReport | None = None

    # ------------------------------------------------------------------ the training thread

    def beat(self) -> None:
        """A step boundary: progress."""
        self.beats += 1

    @contextlib.contextmanager
    def not_a_hang(self) -> Iterator[None]:
        """No hang is counted inside the block; the clock starts afresh after it."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beats += 1

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        """Start the watchdog's thread (a daemon: it never keeps the process alive)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="accelkit-watchdog", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop watching (the end of the run)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _watch(self) -> None:
        seen = self.beats
        since: float | None = None  # when the count last changed (None: no step yet)
        while not self._stop.wait(self.poll_seconds):
            now = time.monotonic()
            beats = self.beats
            if self._paused or beats != seen:
                seen, since = beats, now
            elif since is not None and now - since > self.timeout_seconds:
                self._hang(self.rank, now - since)
                return
            peer = self._peer_hang()
            if peer is not None:
                self._hang(peer, 0.0 if since is None else now - since)
                return

    def _peer_hang(self) -> int | None:
        """The rank that reported a hang through the store, if one did."""
        if self.store is None:
            return None
        try:
            if not self.store.check([HANG_KEY]):
                return None
            return int(json.loads(self.store.get(HANG_KEY))["rank"])
        except Exception:  # the store's server went away: the job is ending anyway
            return None

    def _hang(self, detected_by: int, stalled: float) -> None:
        """Write the stacks, tell the others, report, wait for them, exit."""
        path = stack_file(self.stack_folder, self.rank)
        report = HangReport(
            rank=self.rank,
            host=socket.gethostname(),
            detected_by=detected_by,
            stalled_seconds=round(stalled, 3),
            steps=self.beats,
            stack_file=path,
            stack_folder=self.stack_folder,
        )
        self.report = report
        self._write_stacks(report)
        if self.store is not None and detected_by == self.rank:
            with contextlib.suppress(Exception):
                self.store.set(HANG_KEY, json.dumps({"rank": self.rank, "host": report.host}))
        if self.on_hang is not None:
            try:
                self.on_hang(report)
            except Exception:
                logger.exception("accelkit: watchdog: reporting the hang failed")
        self._wait_for_others()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._exit(self.exit_code)

    def _write_stacks(self, report: HangReport) -> None:
        try:
            os.makedirs(self.stack_folder, exist_ok=True)
            with open(report.stack_file, "w", encoding="utf-8") as f:
                cause = (
                    f"no step progress for {report.stalled_seconds:.1f} s"
                    if report.detected_by == self.rank
                    else f"rank {report.detected_by} saw no step progress"
                )
                f.write(
                    f"accelkit watchdog: rank {self.rank} on {report.host} (pid {os.getpid()}): "
                    f"{cause} (hang_timeout_seconds={self.timeout_seconds:g}); "
                    f"{report.steps} step boundaries passed.\n"
                )
                trail = describe()
                f.write(
                    "The collective each thread entered last through accelkit "
                    "(torch's own, like DDP's all-reduce in backward, show in the stacks):\n"
                    + "".join(f"  {line}\n" for line in trail or ["none"])
                    + "\nEvery thread's Python stack, most recent call first:\n\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as exc:
            logger.error("accelkit: watchdog: cannot write %s (%s)", report.stack_file, exc)

    def _wait_for_others(self) -> None:
        """Count this process as done and wait (up to :attr:`grace_seconds`) for the others."""
        if self.store is None or self.world_size <= 1:
            return
        try:
            done = int(self.store.add(_DONE_KEY, 1))
            deadline = time.monotonic() + self.grace_seconds
            while done < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                done = int(self.store.add(_DONE_KEY, 0))
        except Exception:
            return
