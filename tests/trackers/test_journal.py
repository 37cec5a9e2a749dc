"""The tracker journal (#27): retried, caught up and synced later, every point exactly once."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from accelkit import Accelerator, ProjectConfiguration
from accelkit.cli.main import main as cli
from accelkit.trackers import TrackerWarning, register_tracker
from accelkit.trackers.delivery.journal import JOURNAL_FOLDER, Journal, JournalWarning
from accelkit.trackers.delivery.sync import status
from tests.trackers.custom import CSVTracker


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.001")
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "0.2")  # how long end_training keeps trying


class FlakyCSV(CSVTracker):
    """The CSV tracker behind a network that is down for its first ``fails`` log calls, or
    while a ``DOWN`` file sits in the logging directory."""

    name = "flaky_csv"

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        self.fails = int(kwargs.pop("fails", 0))
        super().__init__(run_name, logging_dir, **kwargs)
        self.down_flag = os.path.join(logging_dir or ".", "DOWN")
        self.calls = 0

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls += 1
        if self.calls <= self.fails or os.path.exists(self.down_flag):
            raise ConnectionError("connection refused (the test's outage)")
        if values.get("bad") is not None:
            raise ValueError(f"value {values['bad']!r} refused by the backend")
        super().log(values, step, **kwargs)
        self.file.flush()


def _rows(logging_dir: Path, run: str = "run") -> list[tuple[int, float]]:
    text = (logging_dir / run / "custom.csv").read_text()
    rows = [line.split(",") for line in text.splitlines()]
    return [(int(step), float(value)) for step, key, value in rows if key == "x"]


def _accelerator(tmp_path: Path, **config: Any) -> Accelerator:
    return Accelerator(
        log_with="flaky_csv",
        project_config=ProjectConfiguration(project_dir=str(tmp_path), **config),
    )


def test_a_tracker_failing_its_first_500_calls_ends_with_every_point_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "20")
    register_tracker(FlakyCSV)
    accelerator = _accelerator(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.init_trackers("run", init_kwargs={"flaky_csv": {"fails": 500}})
        for step in range(800):
            accelerator.log({"x": float(step)}, step=step)
        accelerator.end_training()
    assert _rows(tmp_path) == [(s, float(s)) for s in range(800)]
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(reports) == 1 and "retried with backoff" in reports[0], reports
    (journal,) = status(str(tmp_path))
    assert (journal.journaled, journal.delivered, journal.pending) == (800, 800, 0)


def test_a_refused_value_skips_only_its_entry_and_is_reported_once(tmp_path: Path) -> None:
    register_tracker(FlakyCSV)
    accelerator = _accelerator(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.init_trackers("run")
        for step in range(10):
            bad = "nope" if step in (3, 6) else None
            accelerator.log({"x": float(step), "bad": bad}, step=step)
        accelerator.end_training()
    assert _rows(tmp_path) == [(s, float(s)) for s in range(10) if s not in (3, 6)]
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(reports) == 1, reports
    assert "refused" in reports[0] and "step 3" in reports[0] and "fix the value" in reports[0]


def test_a_backend_that_never_comes_back_is_synced_later_exactly_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    register_tracker(FlakyCSV)
    accelerator = _accelerator(tmp_path)
    accelerator.init_trackers("run")
    for step in range(5):
        accelerator.log({"x": float(step)}, step=step)
    accelerator.get_tracker("flaky_csv")  # flushed: steps 0-4 delivered
    (tmp_path / "DOWN").touch()
    for step in range(5, 300):
        accelerator.log({"x": float(step)}, step=step)
    with caplog.at_level(logging.ERROR, "accelkit.trackers"), warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        accelerator.end_training()
    assert "295 journaled entries were not delivered" in caplog.text
    assert f"accelkit track sync {tmp_path} --tracker flaky_csv" in caplog.text
    assert _rows(tmp_path) == [(s, float(s)) for s in range(5)]

    capsys.readouterr()
    assert cli(["track", "status", str(tmp_path), "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["journaled"], row["delivered"], row["pending"]) == (300, 5, 295)

    (tmp_path / "DOWN").unlink()
    assert cli(["track", "sync", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "flaky_csv: sent 295 entries (seq 5..299); 0 pending" in out
    assert _rows(tmp_path) == [(s, float(s)) for s in range(300)]
    # Running it again sends nothing twice.
    assert cli(["track", "sync", str(tmp_path), "--tracker", "flaky_csv"]) == 0
    assert "nothing to send" in capsys.readouterr().out
    assert _rows(tmp_path) == [(s, float(s)) for s in range(300)]


def test_sync_of_an_unknown_tracker_says_so_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = Journal.open(str(tmp_path), "gone")
    journal.write_run({"tracker": "gone", "project_name": "run", "reference": None})
    journal.write([journal.entry("log", 0, {"x": 1.0})])
    journal.close()
    assert cli(["track", "sync", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "gone: nothing to send; 1 pending" in out and "Unknown tracker 'gone'" in out
    assert cli(["track", "sync", str(tmp_path / "missing")]) == 2


def test_the_cap_keeps_the_newest_entries_and_says_so_once(tmp_path: Path) -> None:
    journal = Journal.open(str(tmp_path), "t", max_bytes=40_000, segment_bytes=4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for start in range(0, 3000, 100):
            journal.write(
                [journal.entry("log", s, {"x": float(s)}) for s in range(start, start + 100)]
            )
    said = [w for w in caught if issubclass(w.category, JournalWarning)]
    assert len(said) == 1 and "cap of" in str(said[0].message)
    size = sum(f.stat().st_size for f in Path(journal.folder).glob("*.jsonl"))
    assert size <= 40_000 + 4096 + 8000  # the cap, plus the segment being written
    pending = journal.pending()
    steps = [entry.step for entry in pending]
    assert steps == list(range(steps[0], 3000)) and steps[0] > 0  # the newest, in order
    assert journal.acked == steps[0] - 1 and journal.dropped == steps[0]


def test_resume_drops_journal_entries_past_the_checkpoint(tmp_path: Path) -> None:
    register_tracker(FlakyCSV)
    accelerator = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    accelerator.init_trackers("run")
    for step in range(4):
        accelerator.log({"x": float(step)}, step=step)
    accelerator.save_state()
    (tmp_path / "DOWN").touch()
    for step in range(4, 9):
        accelerator.log({"x": float(step)}, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        accelerator.end_training()
    (tmp_path / "DOWN").unlink()

    resumed = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    resumed.load_state()
    resumed.init_trackers("run")
    for step in range(4, 6):
        resumed.log({"x": 100.0 + step}, step=step)
    resumed.end_training()
    # Steps 4-8 of the first job were never delivered and are dropped: the resumed run logs
    # its own; nothing is left for sync.
    assert _rows(tmp_path) == [(s, float(s)) for s in range(4)] + [(4, 104.0), (5, 105.0)]
    (journal,) = status(str(tmp_path))
    assert journal.pending == 0


def test_hostile_journal_files_are_reported_and_never_stop_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / JOURNAL_FOLDER / "flaky_csv"
    folder.mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret\n")
    (folder / "000000000000.jsonl").write_text(
        '{"seq":0,"kind":"log","step":0,"time":1,"values":{"x":1}}\nnot json\n{"seq":1,"ki'
    )
    (folder / "000000000100.jsonl").symlink_to(outside)
    os.mkfifo(folder / "000000000200.jsonl")
    (folder / "acked").symlink_to(outside)
    # `track status` reads it as untrusted: problems reported, no link followed, no hang.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli(["track", "status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "not a journal entry" in out and "cut short" in out
    assert "symbolic link" in out or "symbolic link" in " ".join(str(w.message) for w in caught)
    assert outside.read_text() == "secret\n"

    register_tracker(FlakyCSV)
    accelerator = _accelerator(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.init_trackers("run")
        for step in range(3):
            accelerator.log({"x": float(step)}, step=step)
        accelerator.end_training()
    assert _rows(tmp_path) == [(s, 0.0 + s) for s in range(3)]  # training logged on
    said = " ".join(str(w.message) for w in caught)
    assert "symbolic link" in said or "named pipe" in said
    assert outside.read_text() == "secret\n"


class HangingCSV(CSVTracker):
    """The CSV tracker behind a backend whose ``log`` does not return while a ``HANG`` file
    sits in the logging directory (a request that hangs rather than fails)."""

    name = "hanging_csv"
    entered = threading.Event()

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.hang_flag = os.path.join(logging_dir or ".", "HANG")

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        deadline = time.monotonic() + 60
        while os.path.exists(self.hang_flag) and time.monotonic() < deadline:
            HangingCSV.entered.set()
            time.sleep(0.01)
        super().log(values, step, **kwargs)
        self.file.flush()


def test_values_queued_behind_a_hung_backend_call_are_journaled_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The soak's finding: while the worker hung in a backend call, nothing queued behind it
    was journaled, and the end of the run dropped it. Now the hub journals the queue itself
    when it stops waiting, the hung call's return sends the rest from the journal, once."""
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "1")  # finish() waits 1 s for the hung call
    register_tracker(HangingCSV)
    HangingCSV.entered.clear()
    accelerator = Accelerator(
        log_with="hanging_csv", project_config=ProjectConfiguration(project_dir=str(tmp_path))
    )
    accelerator.init_trackers("run")
    for step in range(5):
        accelerator.log({"x": float(step)}, step=step)
    accelerator.get_tracker("hanging_csv")  # flushed: steps 0-4 delivered
    (tmp_path / "HANG").touch()
    accelerator.log({"x": 5.0}, step=5)
    assert HangingCSV.entered.wait(30), "the worker never reached the hanging call"
    for step in range(6, 300):  # queued behind the hung call
        accelerator.log({"x": float(step)}, step=step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.end_training()
    late = [str(w.message) for w in caught if "did not finish" in str(w.message)]
    assert len(late) == 1 and "kept in its journal" in late[0], late
    assert f"accelkit track sync {tmp_path} --tracker hanging_csv" in late[0]
    (row,) = status(str(tmp_path))
    assert (row.journaled, row.delivered) == (300, 5)  # nothing left only in memory

    # The backend answers again: the worker (alive in this process) sends the rest, once.
    (tmp_path / "HANG").unlink()
    deadline = time.monotonic() + 60
    while len(_rows(tmp_path)) < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rows(tmp_path) == [(s, float(s)) for s in range(300)]
    deadline = time.monotonic() + 30
    while status(str(tmp_path))[0].pending and time.monotonic() < deadline:
        time.sleep(0.05)
    capsys.readouterr()
    assert cli(["track", "sync", str(tmp_path), "--tracker", "hanging_csv"]) == 0
    assert "nothing to send" in capsys.readouterr().out
    assert _rows(tmp_path) == [(s, float(s)) for s in range(300)]


def test_a_queue_outgrowing_its_bound_behind_a_hung_call_is_journaled_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a journal, a queue past ACCELKIT_TRACKER_MAX_PENDING behind a hung call is
    dropped and the tracker skipped; with one, the queue goes to the journal and the tracker
    stays: every point arrives once the backend answers."""
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "0.5")  # stuck after half a second
    monkeypatch.setenv("ACCELKIT_TRACKER_MAX_PENDING", "300")
    register_tracker(HangingCSV)
    HangingCSV.entered.clear()
    accelerator = Accelerator(
        log_with="hanging_csv", project_config=ProjectConfiguration(project_dir=str(tmp_path))
    )
    accelerator.init_trackers("run")
    (tmp_path / "HANG").touch()
    accelerator.log({"x": 0.0}, step=0)
    assert HangingCSV.entered.wait(30), "the worker never reached the hanging call"
    time.sleep(0.7)  # past the timeout: the worker is stuck
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 2000):
            accelerator.log({"x": float(step)}, step=step)
    said = [str(w.message) for w in caught]
    assert any("kept in its journal" in m for m in said), said
    assert not any(issubclass(w.category, TrackerWarning) for w in caught), said  # not skipped
    (tmp_path / "HANG").unlink()
    accelerator.end_training()
    assert _rows(tmp_path) == [(s, float(s)) for s in range(2000)]
    (row,) = status(str(tmp_path))
    assert (row.journaled, row.delivered, row.pending) == (2000, 2000, 0)
