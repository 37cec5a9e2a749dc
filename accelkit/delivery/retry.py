"""One backoff: :class:`RetryPolicy` (the schedule), :func:`retry_call` (a call retried under it)
and :class:`Backoff` (the schedule followed by a service that stopped answering).

Checkpoint storage retries each request under a :class:`RetryPolicy` with jitter and a deadline
(:func:`retry_call`); replication does the same with no deadline; a tracker's start and
deliveries follow a :class:`Backoff` without jitter, from its background thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from accelkit.delivery.failures import TRANSIENT, classify
from accelkit.errors import ConfigurationError

__all__ = ["Backoff", "RetryPolicy", "retry_call"]

logger = logging.getLogger("accelkit.delivery")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried: exponential backoff with jitter.

    The n-th wait is ``min(max_delay, base_delay * multiplier**n)``, scaled by a random factor
    in ``[1 - jitter, 1]`` (so many clients do not retry in step).

    Args:
        base_delay: the first wait, in seconds.
        max_delay: the longest wait.
        multiplier: growth of the wait per attempt.
        jitter: fraction of each wait that is random (0: none; 1: "full jitter").
        deadline: give up on one operation after this many seconds of retrying (``None``:
            keep trying; the replicator stops when asked to).

    Raises:
        ConfigurationError: a negative delay, a multiplier below 1, a jitter outside ``[0, 1]``
            (a ``ValueError``).
    """

    base_delay: float = 0.25
    max_delay: float = 15.0
    multiplier: float = 2.0
    jitter: float = 0.5
    deadline: float | None = 120.0

    def __post_init__(self) -> None:
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ConfigurationError(
                f"RetryPolicy needs 0 <= base_delay <= max_delay, got base_delay="
                f"{self.base_delay!r}, max_delay={self.max_delay!r}."
            )
        if self.multiplier < 1:
            raise ConfigurationError(
                f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}."
            )
        if not 0 <= self.jitter <= 1:
            raise ConfigurationError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter!r}.")
        if self.deadline is not None and self.deadline < 0:
            raise ConfigurationError(
                f"RetryPolicy.deadline must be >= 0 seconds or None, got {self.deadline!r}."
            )

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after failed attempt number ``attempt`` (0-based)."""
        raw = min(self.max_delay, self.base_delay * self.multiplier ** min(attempt, 64))
        if not self.jitter:
            return raw
        spread = (rng or random).random() * self.jitter
        return raw * (1.0 - spread)


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    should_stop: Callable[[], bool] | None = None,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, retrying :data:`~accelkit.delivery.failures.TRANSIENT`
    errors under ``policy``.

    A hard error, an error that is neither, or a transient one past the policy's deadline (or
    once ``should_stop()`` is true) is raised as it is; the last transient one carries a note
    saying how long it was retried.

    Args:
        fn: the operation (called again from the start on each attempt).
        policy: the backoff.
        what: names the operation in log lines (``"upload of s3://b/run/x"``).
        should_stop: checked before each wait: true ends the retries.
        on_retry: ``on_retry(error, attempt, wait)`` before each wait (default: a debug line).
        sleep: how to wait (an ``Event.wait`` makes waits interruptible).
    """
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if classify(exc) != TRANSIENT:
                raise
            elapsed = time.monotonic() - started
            wait = policy.delay(attempt)
            over = policy.deadline is not None and elapsed + wait > policy.deadline
            if over or (should_stop is not None and should_stop()):
                note = getattr(exc, "add_note", None)  # Python >= 3.11
                if note is not None:
                    note(
                        f"accelkit retried {what} for {elapsed:.1f} s ({attempt + 1} attempts) "
                        "before giving up."
                    )
                raise
            if on_retry is not None:
                on_retry(exc, attempt, wait)
            else:
                logger.debug("%s failed (%s); retrying in %.2f s", what, exc, wait)
            sleep(wait)
            attempt += 1


class Backoff:
    """When to try again a service that does not answer: the waits of a :class:`RetryPolicy`,
    one after each failure, from the first failure of an outage until it answers.

    Args:
        policy: the schedule, or a function that gives it (asked at each failure, so that a
            setting read from the environment applies at once).

    Attributes:
        retry_at: the ``time.monotonic()`` of the next try (``0.0``: none scheduled).
        outage: when the service stopped answering (``None``: it answers).
    """

    def __init__(self, policy: RetryPolicy | Callable[[], RetryPolicy]) -> None:
        self._policy = policy
        self.retry_at = 0.0
        self.outage: float | None = None
        self._attempt = 0

    def failed(self) -> bool:
        """Schedule the next try; True for the first failure of an outage (to be said)."""
        now = time.monotonic()
        first = self.outage is None
        if first:
            self.outage = now
        policy = self._policy if isinstance(self._policy, RetryPolicy) else self._policy()
        self.retry_at = now + policy.delay(self._attempt)
        self._attempt += 1
        return first

    def answered(self) -> float | None:
        """The service answered: start over; returns how long its outage lasted, if any."""
        lasted = None if self.outage is None else time.monotonic() - self.outage
        self.outage = None
        self._attempt = 0
        self.retry_at = 0.0
        return lasted
