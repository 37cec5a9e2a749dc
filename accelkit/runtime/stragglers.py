"""Stragglers: a rank whose own part of the step stays slower than the others', reported once.

In data-parallel training every rank's step takes as long as the slowest one's: the fast ranks
wait for it in the gradient all-reduce. What differs between ranks is the time each spends on
its own before that wait: here, a step's time outside ``accelerator.backward()`` (the data
loader, the forward, the script's own code, the optimizer step), where DDP's all-reduce runs
inside ``backward``. A rank slowed by its loader, its host or its own code has more of it; the
others have less (they wait inside ``backward`` instead).

The times ride on the save decisions' agreement (:class:`~accelkit.runtime.saving.RoundRider`):
each rank puts its mean time per step since the last round, in microseconds, into its own slot
of a vector of ``world_size`` zeros, and the agreement's ``all_reduce(MAX)`` hands every rank
every rank's time. No collective of its own, nothing per step but two clock readings around
``backward``. A rank is a straggler when its time stays above the median of the other ranks' by
more than ``fraction`` in every round for ``steps`` optimizer steps in a row; it is reported
once per run. A round carries the mean over its steps (rounds are ``round_every`` steps apart:
about 50 ms of training), so one slow step among fast ones is diluted, and a spike shorter than
``steps`` ends its streak.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = ["Straggler", "StragglerDetector", "check_straggler_settings"]


def check_straggler_settings(fraction: object, steps: object) -> None:
    """Refuse settings the report cannot use.

    Raises:
        ConfigurationError: naming the value, what is expected and an example.
    """
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0
    ):
        raise ConfigurationError(
            f"straggler_fraction={short(fraction)}: expected how much slower than the others' "
            "median a rank's step must be, as a number above 0 (0.2: 20% slower), or None for "
            "no straggler report."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigurationError(
            f"straggler_steps={short(steps)}: expected the number of optimizer steps (1 or "
            "more) over which a rank must stay slower to be reported, e.g. straggler_steps=50."
        )


@dataclass(frozen=True)
class Straggler:
    """A rank found slower than the others.

    Attributes:
        rank: the slow rank.
        step_seconds: its time per step outside ``backward`` over its streak.
        median_seconds: the median of the other ranks' over the same steps.
        steps: the optimizer steps of the streak.
    """

    rank: int
    step_seconds: float
    median_seconds: float
    steps: int


class StragglerDetector:
    """Step times on the agreement's rounds, and the report (see the module's docstring).

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        fraction: how much slower than the others' median counts (0.2: 20%).
        steps: for how many optimizer steps in a row a rank must stay slower.
        waiting: seconds spent inside ``backward`` so far (a running total), subtracted from
            the time between rounds.
        report: called once per straggler, on every process alike.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        fraction: float,
        steps: int,
        waiting: Callable[[], float],
        report: Callable[[Straggler], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.fraction = fraction
        self.steps = steps
        self.waiting = waiting
        self.report = report
        self.clock = clock
        self.reported: set[int] = set()
        self._last: tuple[int, float, float] | None = None  # (steps, time, waiting) last round
        self._round_steps = 0  # optimizer steps whose times the round in flight carries
        self._agreed_steps = 0  # ... and those of the round read next
        # rank -> (steps, its seconds, the others' median seconds) of its streak of slow
        # rounds, where it has one.
        self._streaks: dict[int, tuple[int, float, float]] = {}

    def contribute(self, steps: int) -> list[int]:
        """This rank's mean time per step outside ``backward`` since the last round (in its own
        slot; zeros elsewhere)."""
        now, waiting = self.clock(), self.waiting()
        values = [0] * self.world_size
        last = self._last
        self._last = (steps, now, waiting)
        self._agreed_steps = self._round_steps
        if last is None or steps <= last[0]:
            self._round_steps = 0
            return values
        taken = steps - last[0]
        own = max(0.0, (now - last[1]) - (waiting - last[2])) / taken
        values[self.rank] = max(1, int(own * 1e6))
        self._round_steps = taken
        return values

    def agreed(self, values: list[int]) -> None:
        """The previous round's times of every rank: count each rank's streak of steps above
        the others' median by :attr:`fraction`; report a streak of :attr:`steps`."""
        steps = self._agreed_steps
        if not steps or len(values) != self.world_size or min(values) <= 0:
            return  # the first rounds, or one after a pause (a load, a save)
        for r, micros in enumerate(values):
            median = statistics.median(values[:r] + values[r + 1 :])
            if micros <= median * (1 + self.fraction):
                self._streaks.pop(r, None)
                continue
            taken, own, others = self._streaks.get(r, (0, 0.0, 0.0))
            streak = (taken + steps, own + steps * micros / 1e6, others + steps * median / 1e6)
            self._streaks[r] = streak
            if streak[0] >= self.steps and r not in self.reported:
                self.reported.add(r)
                self.report(
                    Straggler(
                        rank=r,
                        step_seconds=streak[1] / streak[0],
                        median_seconds=streak[2] / streak[0],
                        steps=streak[0],
                    )
                )
