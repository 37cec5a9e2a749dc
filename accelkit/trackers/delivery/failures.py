"""What a tracker's failure costs the run: `FailurePolicy`, and what it reports (`TrackerFailure`,
`TrackerWarning`, `TrackerError`).

A tracker is somebody else's network service. The hub (fan-out and the runs' lifecycle) and each
tracker's worker (its queue, thread and backend calls) meet here: the hub creates one
:class:`FailurePolicy` per run of trackers and hands it to every worker, and both ask it what to
do when a backend raises or hangs. Neither calls the other to report.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelkit._env import number
from accelkit._text import short
from accelkit.delivery.drain import ReportOnce
from accelkit.delivery.failures import HARD, REFUSED
from accelkit.delivery.failures import classify as classify_failure
from accelkit.delivery.retry import RetryPolicy
from accelkit.errors import AccelkitError, ConfigurationError, warn_at_user_line

__all__ = [
    "FailurePolicy",
    "TrackerError",
    "TrackerFailure",
    "TrackerWarning",
    "classify",
    "retry_policy",
]

_POLICIES = ("warn", "raise")

logger = logging.getLogger("accelkit.trackers")


_FIRST_RETRY_S = 0.5


def retry_policy(longest: float | None = None) -> RetryPolicy:
    """The backoff of a backend that does not answer (a tracker's start and its deliveries
    share one): after 0.5 s, doubling up to ``longest`` seconds (``None``:
    ``ACCELKIT_TRACKER_RETRY_MAX_S``, 30 by default), without jitter."""
    if longest is None:
        longest = number("ACCELKIT_TRACKER_RETRY_MAX_S")
    return RetryPolicy(
        base_delay=min(_FIRST_RETRY_S, longest), max_delay=longest, jitter=0.0, deadline=None
    )


def classify(error: BaseException) -> str | None:
    """What retrying can do about a backend's error: the delivery room's
    :func:`~accelkit.delivery.failures.classify` of the error itself (not its causes: a
    client's handled errors stay on ``__context__``), Python's own types read as the client's
    answer.

    Returns:
        ``REFUSED``: the backend refuses this value (``TypeError``, ``ValueError``,
        ``KeyError``, or an ``error_code`` such as ``INVALID_PARAMETER_VALUE``): only this entry
        is skipped. ``HARD``: retrying cannot help the run at all (``PermissionError``,
        ``UNAUTHENTICATED``/``PERMISSION_DENIED``/``RESOURCE_DOES_NOT_EXIST``, HTTP 401, 403,
        404): the tracker is reported and skipped, its journal kept for ``accelkit track
        sync``. ``TRANSIENT`` or ``None``: retried (a connection refused, a timeout, a server
        error, anything else).
    """
    return classify_failure(error, chain=False, builtin_types=True)


class TrackerWarning(UserWarning):
    """A tracker failed and is skipped from now on (``on_error="warn"``)."""


class TrackerError(AccelkitError, RuntimeError):
    """A tracker failed (``on_error="raise"``); ``failure`` says which and where."""

    def __init__(self, failure: TrackerFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


@dataclass(frozen=True)
class TrackerFailure:
    """One tracker failure: which tracker, in which method, and the exception."""

    name: str
    method: str
    error: BaseException

    def describe(self) -> str:
        """A one-line report naming the tracker and the error."""
        text = (
            f"Tracker {self.name!r} failed in {self.method}(): {type(self.error).__name__}: "
            f"{self.error}. It is skipped from now on; the other trackers continue."
        )
        if self.method == "start" and classify(self.error) in (HARD, REFUSED):
            text += (
                " Retrying cannot fix this error (a credential, a setting or a value the "
                f"backend refuses): correct init_kwargs[{self.name!r}] or the backend's "
                "environment variables and start the run again."
            )
        return text


class FailurePolicy:
    """What happens when a tracker raises or hangs, decided in one place.

    - A failure is recorded and reported once, naming the tracker and the method: a
      :class:`TrackerWarning` under ``"warn"``; under ``"raise"`` it is kept and raised as a
      :class:`TrackerError` by :meth:`raise_pending` at the hub's next call. The caller marks
      the tracker failed first (exactly one caller reports it), and ``on_skip`` is told, so
      the owner stops feeding it: it is skipped for the rest of the run.
    - When every tracker of the run has failed, one error-level record (logger
      ``accelkit.trackers``) says that nothing is being logged any more.
    - No wait is unbounded: a run that does not open within ``timeout`` seconds, a backend call
      longer than ``timeout`` with more than ``max_pending`` values waiting behind it, and a
      ``flush``/``finish`` that does not complete in time are reported, with the setting that
      fixes them.

    Warnings point at the first caller outside accelkit (the user's ``log()``,
    ``init_trackers()`` or ``end_training()`` line). A failure found on a tracker's own thread,
    or at interpreter exit, has no such line: its warning names no file (``<accelkit
    trackers>``) rather than one inside accelkit.

    Args:
        on_error: ``"warn"`` or ``"raise"``.
        timeout: the most seconds a run may take to open, and one backend call may run while
            values pile up behind it.
        max_pending: how many values may wait for a tracker whose backend call has run past
            ``timeout`` before it is skipped; default ``ACCELKIT_TRACKER_MAX_PENDING`` or
            50 000.
        drain: the most seconds the end of a run gives a journaled tracker whose backend does
            not answer (delivery retried, or one backend call that has not returned: a client's
            own retries); what it has not sent stays in its journal. Default
            ``ACCELKIT_TRACKER_DRAIN_S`` or 10, at most half of ``timeout``.
        on_skip: called (without arguments, on the thread that found the failure) once a
            failure is recorded.
        retry_max: the longest wait between two tries of a backend that does not answer
            (``None``: ``ACCELKIT_TRACKER_RETRY_MAX_S`` when a retry is scheduled, or 30).

    Attributes:
        pending: the failure :meth:`raise_pending` raises next (``on_error="raise"``), or
            ``None``; a plain attribute, read on every ``log()``.

    Raises:
        ValueError: ``on_error`` is neither ``"warn"`` nor ``"raise"``.
    """

    def __init__(
        self,
        on_error: str = "warn",
        *,
        timeout: float = 60.0,
        max_pending: int | None = None,
        drain: float | None = None,
        on_skip: Callable[[], None] | None = None,
        retry_max: float | None = None,
    ) -> None:
        if on_error not in _POLICIES:
            raise ConfigurationError(
                f"tracker_errors={on_error!r} is not supported; expected 'warn' or 'raise'."
            )
        self.on_error = on_error
        self.timeout = timeout
        if max_pending is None:
            max_pending = int(number("ACCELKIT_TRACKER_MAX_PENDING"))
        self.max_pending = max_pending
        if drain is None:
            drain = number("ACCELKIT_TRACKER_DRAIN_S")
        self.drain = min(drain, timeout / 2)
        self.on_skip = on_skip
        self.retry_max = retry_max
        self._lock = threading.Lock()
        self._failures: list[TrackerFailure] = []
        self.pending: TrackerFailure | None = None
        self._run_names: frozenset[str] = frozenset()
        self._run_start = 0  # index in _failures of this run's first failure
        self._all_failed_reported = False
        self._retrying_said = ReportOnce()
        self._refused_said = ReportOnce()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the settings only: recorded failures (their exceptions may not pickle), the
        lock and the owner's hook belong to the process that made them."""
        return (
            FailurePolicy,
            (self.on_error,),
            {
                "timeout": self.timeout,
                "max_pending": self.max_pending,
                "drain": self.drain,
                "retry_max": self.retry_max,
            },
        )

    @property
    def failures(self) -> list[TrackerFailure]:
        """Every failure recorded so far (all runs)."""
        return list(self._failures)

    def begin_run(self, names: set[str]) -> None:
        """Start counting the failures of a new run whose trackers are ``names``."""
        with self._lock:
            self._run_names = frozenset(names)
            self._run_start = len(self._failures)
            self._all_failed_reported = False

    def report(self, failure: TrackerFailure) -> None:
        """Record a failure and act on it (see the class docstring).

        The caller has marked the tracker failed, and reports each tracker at most once.
        """
        with self._lock:
            self._failures.append(failure)
            raise_it = self.on_error == "raise"
            if raise_it and self.pending is None:
                self.pending = failure
        if self.on_skip is not None:
            self.on_skip()
        if not raise_it:
            _warn(failure.describe(), TrackerWarning)
        self._check_all_failed()

    def raise_pending(self) -> None:
        """Raise the failure kept under ``"raise"``, once.

        Raises:
            TrackerError: a failure was reported since the last call.
        """
        failure, self.pending = self.pending, None
        if failure is not None:
            raise TrackerError(failure) from failure.error

    def stuck(self, busy: str | None, since: float) -> bool:
        """Whether a backend call (``busy``, begun at monotonic ``since``) has run too long."""
        return busy is not None and time.monotonic() - since > self.timeout

    def start_timed_out(self, name: str, method: str) -> TrackerFailure:
        """The failure of a tracker whose run did not open within ``timeout`` seconds."""
        error = TimeoutError(
            f"{method}() did not return within {self.timeout:g} s; the tracker is left behind. "
            "If the backend is just slow to start, raise TrackerOptions(timeout=...) or "
            "ACCELKIT_TRACKER_TIMEOUT (seconds)"
        )
        return TrackerFailure(name, method, error)

    def overflowed(self, name: str, waiting: int, busy: str | None) -> TrackerFailure:
        """The failure of a tracker whose queue outgrew ``max_pending`` (its backend is hung)."""
        state = f"busy in {busy}()" if busy else "not draining its queue"
        error = TimeoutError(
            f"{waiting} values waiting ({state}): the backend is hung or far slower than the "
            "training loop. Raise TrackerOptions(max_pending=...) or "
            "ACCELKIT_TRACKER_MAX_PENDING if it is only slow"
        )
        return TrackerFailure(name, "log", error)

    def late(
        self,
        name: str,
        what: str,
        limit: float,
        busy: str | None,
        journal: str | None = None,
        setting: str = "ACCELKIT_TRACKER_TIMEOUT",
    ) -> None:
        """Warn that a tracker did not ``what`` (flush, finish) within ``limit`` seconds; it is
        not waited for any longer, but not skipped either. ``journal``: the folder of the
        journal its waiting values were written to (then nothing is lost); ``setting``: the
        environment variable that sets ``limit``."""
        if journal:
            logdir = os.path.dirname(os.path.dirname(journal))
            fate = (
                f"The values it has not sent are kept in its journal {journal}: sent when it "
                f"answers, or with: accelkit track sync {logdir} --tracker {name}."
            )
        else:
            fate = "Values it has not written yet may be lost."
        _warn(
            f"Tracker {name!r} did not {what} within {limit:g} s ("
            + (f"busy in {busy}()" if busy else "values still queued")
            + f"); not waiting for it any longer. {fate} "
            f"If the backend is just slow, raise {setting} (seconds).",
            TrackerWarning,
        )

    def kept_while_hung(self, name: str, busy: str | None, journal: str) -> None:
        """Say (once per tracker: the caller keeps count) that the values queued behind a
        backend call that does not return went to the tracker's journal."""
        _warn(
            f"Tracker {name!r}: its backend has not returned from {busy or 'a call'}() for "
            f"over {self.timeout:g} s; the values logged meanwhile are kept in its journal "
            f"{journal} and sent, in order, when it answers (or with `accelkit track sync`). "
            "Training goes on.",
            UserWarning,
        )

    def degraded(self, name: str, what: str) -> None:
        """Warn that a tracker's checkpoint records failed (``what``); its values are still
        logged, so this is not a failure of the tracker."""
        _warn(
            f"Tracker {name!r}: {what}; its checkpoint records are skipped, its values are "
            "still logged.",
            UserWarning,
        )

    def left_behind(self, name: str, reference: Any, error: str | None) -> None:
        """Warn that the run a tracker opened at ``init_trackers`` and gave up for a
        checkpoint's run is kept (``error``: why ``discard_run()`` failed; ``None``: it kept
        the run, which holds values or cannot be deleted)."""
        why = f"discard_run() failed ({error})" if error else "the tracker kept it"
        _warn(
            f"Tracker {name!r}: load_state() continues the checkpoint's run, so the run this "
            f"tracker opened in init_trackers() ({short(reference, 200)}) was finished and is "
            f"left as it is ({why}). Call load_state() before init_trackers() to open only the "
            "checkpoint's run.",
            UserWarning,
        )

    def retrying(self, name: str, method: str, error: BaseException, journal: str | None) -> None:
        """Say that a tracker's backend stopped answering and is retried with backoff: warned
        for a tracker's first outage, logged for the next ones."""
        first = self._retrying_said.first(name)
        kept = (
            f"its values are kept in the journal {journal} and sent, in order, when it answers"
            if journal
            else "values wait in memory meanwhile"
        )
        message = (
            f"Tracker {name!r} failed in {method}() ({type(error).__name__}: {error}); it is "
            f"retried with backoff (at most {retry_policy(self.retry_max).max_delay:g} s apart) "
            f"and {kept}."
        )
        if first:
            _warn(message, TrackerWarning)
        else:
            logger.warning(message)

    def recovered(self, name: str, seconds: float) -> None:
        """Log that a tracker answers again and has caught up."""
        logger.warning(
            "Tracker %r answers again after %.1f s; every journaled value was sent.", name, seconds
        )

    def refused(self, name: str, method: str, seq: int, step: int, error: BaseException) -> None:
        """Warn once per tracker and error type that the backend refused an entry, which is
        skipped (the others are sent)."""
        if not self._refused_said.first((name, type(error).__name__)):
            return
        _warn(
            f"Tracker {name!r} refused the values of {method}() at step {step} (journal entry "
            f"{seq}): {type(error).__name__}: {error}. Retrying cannot fix this, so those "
            "entries are skipped and the others sent; fix the value (its name or type) in the "
            "training script. Further refusals of this kind are not reported.",
            TrackerWarning,
        )

    def undelivered(self, name: str, count: int, journal: str) -> None:
        """Say at the end of a run that entries are left in a tracker's journal (an error-level
        record: the outage itself was warned about when it began)."""
        logdir = os.path.dirname(os.path.dirname(journal))
        logger.error(
            "Tracker %r: %d journaled entries were not delivered (its backend did not answer). "
            "They are kept in %s; send them with: accelkit track sync %s --tracker %s",
            name,
            count,
            journal,
            logdir,
            name,
        )

    def journal_off(self, name: str, error: BaseException) -> None:
        """Warn that a tracker's journal cannot be used; the tracker goes on without it."""
        _warn(
            f"Tracker {name!r}: its journal cannot be used ({type(error).__name__}: {error}); "
            "the tracker goes on without one, so values sent while its backend is down may be "
            "lost. Fix the journal folder (accelkit-journal/ under the logging directory).",
            TrackerWarning,
        )

    def unraised(self, error: TrackerError) -> None:
        """Warn with a failure that had nobody left to raise it to (interpreter exit)."""
        _warn(str(error), TrackerWarning)

    def _check_all_failed(self) -> None:
        """Say once, loudly, that every tracker of the run failed and nothing is logged.

        A tracker failing in ``finish()`` does not count: it logged what it was given.
        """
        with self._lock:
            if self._all_failed_reported or not self._run_names or self.on_error == "raise":
                return
            run = self._failures[self._run_start :]
            failed = {f.name for f in run if f.method != "finish"}
            if not failed >= self._run_names:
                return
            self._all_failed_reported = True
        logger.error(
            "Every tracker of this run has failed (%s): NOTHING IS BEING LOGGED, while training "
            "goes on. Each failure was reported with its cause; fix it (or pass "
            "tracker_errors='raise' to stop at the first failure).",
            ", ".join(repr(name) for name in sorted(failed)),
        )


def _warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line; on a tracker's thread or at exit, at ``<accelkit trackers>``."""
    warn_at_user_line(message, category, where="accelkit trackers")
