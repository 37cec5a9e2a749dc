"""FailurePolicy: the one place that decides what a tracker's failure or hang costs the run.

The hub and each worker receive the same policy; a worker reports to it without any hub. The
warnings it emits point at the user's line where one exists (issue #28), and at no file where
the failure was found on a tracker's own thread.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from accelkit import Accelerator
from accelkit.trackers import TrackerError, TrackerFailure, TrackerHub, TrackerWarning
from accelkit.trackers.delivery.failures import FailurePolicy
from accelkit.trackers.delivery.items import Log, Mark, Stop
from accelkit.trackers.delivery.worker import Worker
from tests.trackers.custom import RecordingTracker

NO_FILE = "<accelkit trackers>"


def _failure(name: str, method: str = "log") -> TrackerFailure:
    return TrackerFailure(name, method, RuntimeError(f"{name} broke"))


def _tracker_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, TrackerWarning)]


def _next_line() -> int:
    """The caller's next line number (where the call whose warning is checked stands)."""
    return sys._getframe(1).f_lineno + 1


class _HangsInStart(RecordingTracker):
    def __init__(self, name: str, gate: threading.Event) -> None:
        super().__init__(name)
        self._gate = gate

    @override
    def start(self) -> None:
        self._gate.wait()


# ---------------------------------------------------------------------------- the policy alone


def test_warn_policy_warns_with_the_tracker_name_and_tells_the_owner_to_skip() -> None:
    skipped: list[int] = []
    policy = FailurePolicy("warn", on_skip=lambda: skipped.append(1))
    with pytest.warns(TrackerWarning, match=r"Tracker 'a' failed in log\(\): RuntimeError: a"):
        policy.report(_failure("a"))
    assert skipped == [1]
    assert [f.name for f in policy.failures] == ["a"]
    policy.raise_pending()  # nothing is kept under "warn"


def test_raise_policy_keeps_the_first_failure_for_the_next_call_and_raises_it_once() -> None:
    skipped: list[int] = []
    policy = FailurePolicy("raise", on_skip=lambda: skipped.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "raise" never warns
        policy.report(_failure("a"))
        policy.report(_failure("b"))
    assert skipped == [1, 1] and policy.pending is not None
    with pytest.raises(TrackerError, match="'a' failed in log") as raised:
        policy.raise_pending()
    assert isinstance(raised.value.__cause__, RuntimeError)
    policy.raise_pending()  # raised once, then cleared
    assert [f.name for f in policy.failures] == ["a", "b"]


def test_an_unknown_policy_name_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"tracker_errors='quiet'.*'warn' or 'raise'"):
        FailurePolicy("quiet")


def test_every_tracker_of_a_run_failing_is_logged_once_and_finish_does_not_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = FailurePolicy("warn")
    policy.begin_run({"a", "b"})
    with caplog.at_level(logging.ERROR, logger="accelkit.trackers"), warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        policy.report(_failure("a"))
        policy.report(_failure("b", "finish"))  # it logged what it was given
        assert not caplog.records
        policy.report(_failure("b"))
        policy.report(_failure("c"))  # not of this run: no second record
        assert len(caplog.records) == 1
        assert "'a', 'b'" in caplog.records[0].getMessage()
        # A new run counts only its own failures.
        policy.begin_run({"a", "d"})
        policy.report(_failure("a"))
        assert len(caplog.records) == 1
        policy.report(_failure("d"))
        assert len(caplog.records) == 2


def test_a_pickled_policy_keeps_its_settings_and_none_of_its_failures() -> None:
    policy = FailurePolicy("raise", timeout=3.5, max_pending=77, on_skip=lambda: None)
    policy.report(TrackerFailure("a", "log", RuntimeError("x")))
    copy = pickle.loads(pickle.dumps(policy))
    assert (copy.on_error, copy.timeout, copy.max_pending) == ("raise", 3.5, 77)
    assert copy.failures == [] and copy.pending is None and copy.on_skip is None
    copy.report(_failure("b"))  # the copy has a working lock and records its own failures
    assert [f.name for f in copy.failures] == ["b"] and len(policy.failures) == 1


def test_the_hub_hands_its_policy_to_every_worker(tmp_path: Path) -> None:
    hub = TrackerHub.create(
        [RecordingTracker("a"), "jsonl"], logging_dir=str(tmp_path), on_error="raise", timeout=7
    )
    hub.init("run")
    try:
        policies = {id(worker.session.policy) for worker in hub._roster.workers}
        assert policies == {id(hub._policy)}
        assert (hub.on_error, hub.timeout) == ("raise", 7)
    finally:
        hub.finish()


# ------------------------------------------------------------------- a worker without any hub


def test_a_worker_reports_to_its_policy_alone_and_skips_the_tracker_after() -> None:
    tracker = RecordingTracker("alone", fail_in="log")
    skipped: list[int] = []
    policy = FailurePolicy("warn", on_skip=lambda: skipped.append(1))
    worker = Worker(tracker, policy)
    worker.session.started = True  # as if its run were open: only the failure keeps finish() away
    values: dict[str, Any] = {"x": 1}
    first: Log = (values, 0, None, False)
    second: Log = (values, 1, None, False)
    worker.log(first)
    worker.log(second)
    with pytest.warns(TrackerWarning, match="'alone' failed in log"):
        assert worker.signal(Mark).wait(10)
    assert tracker.log_attempts == 1  # skipped after its failure: one failing call, not two
    assert worker.session.failed and skipped == [1]
    assert [(f.name, f.method) for f in policy.failures] == [("alone", "log")]
    assert worker.signal(Stop).wait(10)
    worker.thread.join(10)
    assert not worker.thread.is_alive()
    assert tracker.calls == []  # neither the second log() nor finish() reached it


def test_a_worker_passes_log_kwargs_and_the_step_it_was_given() -> None:
    tracker = RecordingTracker("kw")
    worker = Worker(tracker, FailurePolicy())
    item: Log = ({"x": 2}, 5, {"commit": False}, False)
    worker.log(item)
    assert worker.signal(Stop).wait(10)
    assert tracker.calls == [("log", {"x": 2}, (5, {"commit": False}))]


# ------------------------------------------------------------ where the warnings point (#28)


@pytest.mark.slow
def test_a_failure_on_a_trackers_thread_names_no_file_inside_accelkit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # end_training retries the broken tracker within the drain time: 3 s, not the default 10 s,
    # whose backoff made the test wait 7 s for the same report.
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "3")
    broken = RecordingTracker("broken", fail_in="log")
    accelerator = Accelerator(log_with=[broken], project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.log({"x": 1}, step=0)
        accelerator.end_training()
    [report] = _tracker_warnings(caught)
    assert "'broken' failed in log()" in str(report.message)
    assert report.filename == NO_FILE and report.lineno == 0


def test_a_start_timeout_in_init_points_at_the_users_init_line() -> None:
    gate = threading.Event()
    hub = TrackerHub.create([_HangsInStart("slow", gate)], timeout=0.3)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = _next_line()
            hub.init("run")
        [report] = _tracker_warnings(caught)
        assert "'slow' failed in start()" in str(report.message)
        assert (report.filename, report.lineno) == (__file__, line)
    finally:
        gate.set()
        hub.finish()


def test_a_late_flush_points_at_the_users_flush_line() -> None:
    gate = threading.Event()
    hub = TrackerHub.create([RecordingTracker("gated", gate=gate)], timeout=5)
    hub.init("run")
    try:
        hub.log({"x": 1}, step=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = _next_line()
            assert hub.flush(timeout=0.2) is False
        [report] = _tracker_warnings(caught)
        assert "'gated' did not flush within 0.2 s" in str(report.message)
        assert (report.filename, report.lineno) == (__file__, line)
    finally:
        gate.set()
        hub.finish()


def test_a_late_end_training_points_at_the_users_line_through_the_accelerator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "0.3")
    gate = threading.Event()
    accelerator = Accelerator(
        log_with=[RecordingTracker("gated", gate=gate)], project_dir=str(tmp_path)
    )
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = _next_line()
            accelerator.end_training()
        [report] = _tracker_warnings(caught)
        assert "'gated' did not finish within 0.3 s" in str(report.message)
        assert (report.filename, report.lineno) == (__file__, line)
    finally:
        gate.set()


def test_an_overflow_found_in_log_points_at_the_users_log_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_MAX_PENDING", "300")
    gate = threading.Event()
    hub = TrackerHub.create([RecordingTracker("hung", gate=gate)], timeout=0.1)
    hub.init("run")
    try:
        hub.log({"x": 0}, step=0)
        deadline = time.monotonic() + 10
        while hub._roster.workers[0].session.busy != "log" and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the log() call has now run past the timeout
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 400):
                line = _next_line()
                hub.log({"x": step}, step=step)
                if caught:
                    break
        [report] = _tracker_warnings(caught)
        assert "'hung' failed in log()" in str(report.message)
        assert "ACCELKIT_TRACKER_MAX_PENDING" in str(report.message)
        assert (report.filename, report.lineno) == (__file__, line)
        assert hub._roster.workers[0].waiting() == 0  # the waiting values were dropped
    finally:
        gate.set()
        hub.finish()


@pytest.mark.parametrize("name", ["ACCELKIT_TRACKER_DRAIN_S", "ACCELKIT_TRACKER_TIMEOUT"])
@pytest.mark.parametrize("text", ["ten", "-1", "nan"])
def test_a_bad_tracker_setting_is_named_with_its_fix(
    name: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=rf"{name}='{text}': expected a non-negative number"):
        accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
        accelerator.init_trackers("run")
    assert not (tmp_path / "run").exists()  # nothing written before the refusal


def test_the_drain_time_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "3")
    assert FailurePolicy(timeout=60).drain == 3
    assert FailurePolicy(timeout=4).drain == 2  # at most half the timeout
    monkeypatch.delenv("ACCELKIT_TRACKER_DRAIN_S")
    assert FailurePolicy(timeout=60).drain == 10
