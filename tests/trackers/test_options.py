"""``Accelerator(tracker_options=TrackerOptions(...))``: the trackers' waits, retries and journal
as an options object; a field given wins over its ``ACCELKIT_TRACKER_*`` override, a field left
``None`` takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelkit import Accelerator, ProjectConfiguration, TrackerOptions
from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.trackers import register_tracker
from accelkit.trackers.delivery.journal import JOURNAL_FOLDER
from accelkit.trackers.delivery.sync import status
from tests.trackers.test_journal import FlakyCSV, _rows


def _accelerator(tmp_path: Path, options: TrackerOptions) -> Accelerator:
    return Accelerator(
        log_with="flaky_csv",
        project_config=ProjectConfiguration(project_dir=str(tmp_path)),
        tracker_options=options,
    )


def test_the_options_win_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retries 1000 s apart (the variable) would leave the 30 failed calls undelivered after a
    # 10 s drain; the options' 1 ms apart deliver every point.
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "1000")
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "0")
    register_tracker(FlakyCSV)
    accelerator = _accelerator(
        tmp_path, TrackerOptions(retry_max_seconds=0.001, drain_seconds=10.0)
    )
    accelerator.init_trackers("run", init_kwargs={"flaky_csv": {"fails": 30}})
    for step in range(50):
        accelerator.log({"x": float(step)}, step=step)
    accelerator.end_training()
    assert _rows(tmp_path) == [(s, float(s)) for s in range(50)]


def test_a_field_left_none_takes_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_JOURNAL", "0")
    register_tracker(FlakyCSV)
    accelerator = _accelerator(tmp_path, TrackerOptions(timeout=30.0))
    accelerator.init_trackers("run")
    accelerator.log({"x": 1.0}, step=0)
    accelerator.end_training()
    assert not (tmp_path / JOURNAL_FOLDER).exists()
    assert _rows(tmp_path) == [(0, 1.0)]

    # and the option turns it back on
    on = tmp_path / "on"
    accelerator = _accelerator(on, TrackerOptions(journal=True))
    accelerator.init_trackers("run")
    accelerator.log({"x": 1.0}, step=0)
    accelerator.end_training()
    (journal,) = status(str(on))
    assert (journal.journaled, journal.delivered) == (1, 1)


def test_the_journal_cap_is_the_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The backend is down for the whole run: a 0.05 MB journal keeps only the newest values,
    # and says which setting keeps more.
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.001")
    register_tracker(FlakyCSV)
    (tmp_path / "DOWN").write_text("")
    accelerator = _accelerator(tmp_path, TrackerOptions(journal_max_mb=0.05, drain_seconds=0.1))
    with pytest.warns(UserWarning, match=r"TrackerOptions\(journal_max_mb=\.\.\.\)"):
        accelerator.init_trackers("run")
        for step in range(3000):
            accelerator.log({"x": float(step), "padding": "p" * 40}, step=step)
        accelerator.end_training()
    (journal,) = status(str(tmp_path))
    # the oldest were dropped (the default 1024 MB would have kept all 3000)
    assert 0 < journal.pending < 3000


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"timeout": -1.0},
            ConfigurationError,
            r"TrackerOptions\(timeout=-1.0\): expected a finite",
        ),
        ({"max_pending": 0}, ConfigurationError, r"max_pending=0\): expected a finite number >= 1"),
        ({"drain_seconds": float("inf")}, ConfigurationError, r"drain_seconds=inf"),
        ({"journal": "yes"}, WrongTypeError, r"journal='yes'\): expected True or False"),
        ({"retry_max_seconds": "5"}, WrongTypeError, r"retry_max_seconds='5'\): expected a number"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        TrackerOptions(**options)


def test_options_that_are_not_tracker_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WrongTypeError, match=r"tracker_options=\{'timeout': 1\}: expected a Track"):
        Accelerator(project_dir=str(tmp_path), tracker_options={"timeout": 1})  # type: ignore[arg-type]
