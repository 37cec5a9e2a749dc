"""The tracker journal's batches and retried starts (#27): ``GeneralTracker.log_batch`` receives
a backlog in calls acknowledged one by one, in-doubt batches are settled by asking the backend,
and a ``start()`` that fails for a while is retried while values are journaled."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from accelkit import Accelerator, ProjectConfiguration
from accelkit.trackers import GeneralTracker, TrackerWarning, register_tracker
from accelkit.trackers.delivery.journal import Journal, JournalWarning
from accelkit.trackers.delivery.send import deliver
from accelkit.trackers.delivery.sync import status
from tests.trackers.test_journal import FlakyCSV, _rows


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.001")
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "5")


class BatchCSV(FlakyCSV):
    """The flaky CSV tracker with a ``log_batch`` of its own: one write per call, all or
    nothing (a batch holding a ``bad`` value is refused whole)."""

    name = "batch_csv"
    max_batch_values = 50

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.batches: list[int] = []

    @override
    def log_batch(self, batch: Sequence[tuple[dict[str, Any], int, float]]) -> None:
        self.calls += 1
        if self.calls <= self.fails or os.path.exists(self.down_flag):
            raise ConnectionError("connection refused (the test's outage)")
        bad = [values["bad"] for values, _, _ in batch if values.get("bad") is not None]
        if bad:
            raise ValueError(f"value {bad[0]!r} refused by the backend")
        lines = [
            f"{step},{key},{value!r}\n"
            for values, step, _ in batch
            for key, value in values.items()
            if isinstance(value, float)
        ]
        self.file.write("".join(lines))
        self.file.flush()
        self.batches.append(len(batch))


class SlowStartCSV(FlakyCSV):
    """A CSV tracker whose ``start()`` raises ``start_error`` for its first ``start_fails``
    calls (a server not up yet, or a bad credential)."""

    name = "slow_start_csv"

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        self.start_fails = int(kwargs.pop("start_fails", 0))
        self.start_error = kwargs.pop("start_error", ConnectionError)
        super().__init__(run_name, logging_dir, **kwargs)
        self.starts = 0

    @override
    def start(self) -> None:
        self.starts += 1
        if self.starts <= self.start_fails:
            raise self.start_error(f"start attempt {self.starts} failed (the test's server)")
        super().start()


@pytest.fixture(autouse=True)
def registered() -> None:
    register_tracker(BatchCSV)
    register_tracker(SlowStartCSV)


def _one(tmp_path: Path, name: str, init_kwargs: dict[str, Any] | None = None) -> Accelerator:
    accelerator = Accelerator(
        log_with=name, project_config=ProjectConfiguration(project_dir=str(tmp_path))
    )
    accelerator.init_trackers("run", init_kwargs={name: init_kwargs or {}})
    return accelerator


def test_a_backlog_goes_to_log_batch_in_acknowledged_batches_each_point_once(
    tmp_path: Path,
) -> None:
    accelerator = _one(tmp_path, "batch_csv", {"fails": 3})
    tracker = accelerator.get_tracker("batch_csv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1000):
            accelerator.log({"x": float(step)}, step=step)
        accelerator.end_training()
    assert _rows(tmp_path) == [(s, float(s)) for s in range(1000)]
    assert sum(tracker.batches) == 1000
    assert max(tracker.batches) == 50  # its max_batch_values: one value per entry here
    assert len(tracker.batches) <= 1000 // 10, tracker.batches  # batches, not one call each
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(reports) == 1 and "failed in log_batch()" in reports[0], reports
    (journal,) = status(str(tmp_path))
    assert (journal.journaled, journal.delivered, journal.pending) == (1000, 1000, 0)


def test_a_refused_value_in_a_batch_skips_only_its_entry(tmp_path: Path) -> None:
    (tmp_path / "DOWN").touch()  # a backlog builds up: the bad values arrive inside batches
    accelerator = _one(tmp_path, "batch_csv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(200):
            bad = "nope" if step in (3, 120) else None
            accelerator.log({"x": float(step), "bad": bad}, step=step)
        accelerator._trackers.flush()
        (tmp_path / "DOWN").unlink()
        accelerator.end_training()
    assert _rows(tmp_path) == [(s, float(s)) for s in range(200) if s not in (3, 120)]
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    refused = [r for r in reports if "refused the values" in r]
    assert len(refused) == 1 and "step 3" in refused[0], reports
    (journal,) = status(str(tmp_path))
    assert (journal.delivered, journal.pending) == (200, 0)


class Backend(GeneralTracker):
    """A backend that already holds the entries up to ``has_up_to`` (a sender was killed
    mid-batch) and can say so (``probe``) or not."""

    name = "doubt"

    def __init__(self, has_up_to: int) -> None:
        super().__init__()
        self.has_up_to = has_up_to
        self.probes: list[int] = []
        self.received: list[int] = []

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        assert step is not None
        self.received.append(step)

    @override
    def log_batch(self, batch: Sequence[tuple[dict[str, Any], int, float]]) -> None:
        self.received += [step for _, step, _ in batch]


class ProbedBackend(Backend):
    def journal_delivered(self, step: int, values: dict[str, Any]) -> bool:
        self.probes.append(step)
        return step <= self.has_up_to


def _killed_mid_batch(tmp_path: Path) -> Journal:
    """A journal of 40 entries (steps 0-39): 0-9 acknowledged, 10-29 being sent in one
    batch when the sender was killed."""
    journal = Journal.open(str(tmp_path), "doubt")
    entries = [journal.entry("log", step, {"x": float(step)}) for step in range(40)]
    journal.write(entries)
    journal.ack(9)
    journal.sending(29)
    journal.close()
    again = Journal.open(str(tmp_path), "doubt")
    assert (again.acked, again.in_doubt) == (9, 29)
    return again


def test_a_batch_in_doubt_is_settled_by_asking_the_backend(tmp_path: Path) -> None:
    backend = ProbedBackend(has_up_to=17)  # the killed batch's first 8 entries arrived
    journal = _killed_mid_batch(tmp_path)
    sent = deliver(backend, journal, lambda entry: None)
    assert backend.received == list(range(18, 40))  # nothing twice, nothing missing
    assert sent == 22
    assert len(backend.probes) <= 5  # a bisection over the 20 entries in doubt
    assert Journal.open(str(tmp_path), "doubt").acked == 39


def test_a_batch_in_doubt_is_sent_again_with_a_warning_without_a_probe(tmp_path: Path) -> None:
    backend = Backend(has_up_to=17)
    journal = _killed_mid_batch(tmp_path)
    with pytest.warns(JournalWarning, match=r"journal entries 10-29 \(steps 10-29\) were being"):
        deliver(backend, journal, lambda entry: None)
    assert backend.received == list(range(10, 40))


def test_a_start_that_fails_for_a_while_is_retried_and_its_values_delivered(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = _one(tmp_path, "slow_start_csv", {"start_fails": 30})
        for step in range(300):
            accelerator.log({"x": float(step)}, step=step)
        tracker = accelerator.get_tracker("slow_start_csv")
        accelerator.end_training()
    assert tracker.starts == 31
    assert _rows(tmp_path) == [(s, float(s)) for s in range(300)]
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(reports) == 1, reports
    assert "failed in start() (ConnectionError" in reports[0]
    assert "retried with backoff" in reports[0]
    (journal,) = status(str(tmp_path))
    assert (journal.journaled, journal.delivered, journal.pending) == (300, 300, 0)


def test_a_start_refused_for_good_is_reported_once_with_the_fix(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = _one(
            tmp_path, "slow_start_csv", {"start_fails": 10**6, "start_error": PermissionError}
        )
        for step in range(20):
            accelerator.log({"x": float(step)}, step=step)
        tracker = accelerator.get_tracker("slow_start_csv")
        accelerator.end_training()
    assert tracker.starts == 1  # not retried
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(reports) == 1, reports
    assert "failed in start(): PermissionError" in reports[0]
    assert "Retrying cannot fix this error" in reports[0]
    assert "init_kwargs['slow_start_csv']" in reports[0]
