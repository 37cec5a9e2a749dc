"""The straggler report's rule (``accelkit.runtime.stragglers``), fed rounds directly as the
save decisions' agreement hands them over; its settings. The real 2-process jobs are in
``tests/cli/test_launch_watchdog.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelkit import Accelerator
from accelkit.errors import ConfigurationError
from accelkit.runtime.stragglers import Straggler, StragglerDetector, check_straggler_settings


def _detector(found: list[Straggler], world_size: int = 3, steps: int = 10) -> StragglerDetector:
    return StragglerDetector(
        rank=0,
        world_size=world_size,
        fraction=0.2,
        steps=steps,
        waiting=lambda: 0.0,
        report=found.append,
    )


def _rounds(detector: StragglerDetector, times: list[list[float]]) -> None:
    """One round per entry (one optimizer step each): every rank's seconds per step."""
    clock = [0.0]
    detector.clock = lambda: clock[0]
    detector.contribute(0)
    for step, seconds in enumerate(times, start=1):
        clock[0] += seconds[0]
        detector.contribute(step)
        detector.agreed([int(s * 1e6) for s in seconds])


def test_a_rank_that_stays_slower_is_reported_once() -> None:
    found: list[Straggler] = []
    _rounds(_detector(found), [[0.10, 0.10, 0.15]] * 40)
    [straggler] = found
    assert straggler.rank == 2
    assert straggler.step_seconds == pytest.approx(0.15)
    assert straggler.median_seconds == pytest.approx(0.10)
    assert straggler.steps == 10


def test_jitter_and_short_spikes_are_not_stragglers() -> None:
    found: list[Straggler] = []
    # +-10% jitter on every rank, and rank 1 twice as slow for 3 steps in a row.
    pattern = [[0.10, 0.11, 0.09], [0.09, 0.10, 0.11], [0.11, 0.09, 0.10]] * 10
    for i in (12, 13, 14):
        pattern[i] = [0.10, 0.20, 0.10]
    _rounds(_detector(found), pattern)
    assert not found


def test_slower_below_the_fraction_is_not_reported() -> None:
    found: list[Straggler] = []
    _rounds(_detector(found), [[0.10, 0.10, 0.115]] * 40)  # 15% slower, fraction 20%
    assert not found


@pytest.mark.parametrize(
    ("fraction", "steps", "named"),
    [
        (0, 10, "straggler_fraction=0"),
        (-0.5, 10, "straggler_fraction=-0.5"),
        ("x", 10, "straggler_fraction='x'"),
        (0.2, 0, "straggler_steps=0"),
        (0.2, 1.5, "straggler_steps=1.5"),
    ],
)
def test_bad_settings_are_refused_naming_them(fraction: object, steps: object, named: str) -> None:
    with pytest.raises(ConfigurationError, match="expected") as caught:
        check_straggler_settings(fraction, steps)
    assert named in str(caught.value)


def test_the_accelerator_refuses_a_bad_fraction(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="straggler_fraction=-1"):
        Accelerator(project_dir=str(tmp_path), straggler_fraction=-1)
