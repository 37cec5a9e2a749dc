"""TrackerHub: isolation of failing trackers, order, snapshots, bounded waits, stand-ins."""

from __future__ import annotations

import logging
import pickle
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typing_extensions import override

from accelkit import Accelerator, ProjectConfiguration
from accelkit.trackers import (
    GeneralTracker,
    TrackerError,
    TrackerHub,
    TrackerWarning,
    register_tracker,
)
from accelkit.trackers.backends.jsonl import read_jsonl
from accelkit.trackers.base import NullTracker
from accelkit.trackers.delivery.journal import Journal
from tests.trackers import readers
from tests.trackers.custom import RecordingTracker


def _tracker_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["start", "log", "finish"])
def test_a_failing_tracker_is_reported_once_and_the_others_go_on(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # end_training retries the broken tracker within the drain time: 3 s (retries 0.5 and
    # 1.5 s after its failure), not the default 10 s, whose backoff made every run wait 7 s
    # here, for the same report.
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "3")
    broken = RecordingTracker("broken", fail_in=method)
    healthy = RecordingTracker("healthy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(log_with=[broken, "jsonl", healthy], project_dir=str(tmp_path))
        accelerator.init_trackers("run", config={"a": 1})
        for step in range(4):
            accelerator.log({"x": step}, step=step)
        accelerator.end_training()

    reports = _tracker_warnings(caught)
    assert len(reports) == 1, reports
    assert "'broken'" in reports[0] and f"{method}()" in reports[0]
    assert f"broken broke in {method}" in reports[0]
    assert healthy.logged() == [(s, {"x": s}) for s in range(4)]
    assert [r["values"]["x"] for r in read_jsonl(str(tmp_path / "run"))] == [0, 1, 2, 3]
    if method != "log":
        # The broken tracker is skipped after its failure: one failing log call, not four.
        assert broken.log_attempts == {"start": 0, "finish": 4}[method]
        return
    # A failing log() is retried, not dropped (the journal): the first value is tried again
    # (not the next ones, which wait behind it), and all four stay in the journal for sync.
    assert 2 <= broken.log_attempts < 4 + 2
    status = Journal.open(str(tmp_path), "broken").status("broken")
    assert (status.journaled, status.delivered, status.pending) == (5, 1, 4)  # config + 4 logs


def test_raise_policy_raises_at_init_for_start_failures_when_runs_open_eagerly() -> None:
    broken = RecordingTracker("broken", fail_in="start")
    config = ProjectConfiguration(continue_tracker_runs=False)
    accelerator = Accelerator(log_with=[broken], tracker_errors="raise", project_config=config)
    with pytest.raises(TrackerError, match="'broken' failed in start"):
        accelerator.init_trackers("run")


def test_raise_policy_raises_start_failures_at_the_first_use_when_runs_open_lazily() -> None:
    # The default: runs of the trackers log_with names open at their first use, so that a
    # load_state() after init_trackers() can continue the checkpoint's runs.
    built: list[RecordingTracker] = []

    class Continuing(RecordingTracker):
        name = "broken"

        def __init__(self, run_name: str = "") -> None:
            super().__init__("broken", fail_in="start")
            built.append(self)

        @override
        def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
            pass

    register_tracker(Continuing)
    accelerator = Accelerator(log_with=["broken"], tracker_errors="raise")
    accelerator.init_trackers("run")
    [broken] = built
    assert broken.calls == []  # not started yet
    accelerator.log({"x": 1}, step=0)
    with pytest.raises(TrackerError, match="'broken' failed in start"):
        accelerator.end_training()


@pytest.mark.parametrize("continues_runs", [False, True])
def test_a_tracker_instance_is_started_by_init_trackers(continues_runs: bool) -> None:
    # As Accelerate does (#30, #41): its owner may call its methods right after init_trackers,
    # whether or not it continues runs (which a later load_state still does: test_continuity).
    class Continuing(RecordingTracker):
        @override
        def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
            pass

    kind = Continuing if continues_runs else RecordingTracker
    tracker = kind("mine")
    accelerator = Accelerator(log_with=[tracker])
    accelerator.init_trackers("run", config={"a": 1})
    assert [call[0] for call in tracker.calls][:2] == ["start", "config"]
    accelerator.end_training()
    broken = kind("broken", fail_in="start")
    accelerator = Accelerator(log_with=[broken], tracker_errors="raise")
    with pytest.raises(TrackerError, match="'broken' failed in start"):
        accelerator.init_trackers("run")


def test_raise_policy_raises_worker_failures_at_the_next_call() -> None:
    broken = RecordingTracker("broken", fail_in="log")
    hub = TrackerHub.create([broken], on_error="raise")
    hub.init("run")
    hub.log({"x": 1}, step=0)
    with pytest.raises(TrackerError, match="'broken' failed in log") as info:
        hub.flush()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.failure.name == "broken"
    hub.finish()


def test_bad_error_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tracker_errors='ignore'.*'warn' or 'raise'"):
        TrackerHub.create(None, on_error="ignore")


def test_log_keeps_order_and_steps_and_runs_off_the_caller_thread() -> None:
    slow = RecordingTracker("slow", delay=0.001)
    hub = TrackerHub.create([slow])
    hub.init("run")
    for step in range(200):
        hub.log({"i": step, "nested": {"j": step * 2}}, step=step)
    hub.log({"last": True})
    hub.finish()
    logged = slow.logged()
    # The call without a step continues after the last explicit one.
    assert [step for step, _ in logged] == [*range(201)]
    assert all(values["i"] == step for step, values in logged[:200])
    assert logged[-1] == (200, {"last": True})
    assert slow.log_threads == {"accelkit-tracker-slow"}


def test_log_kwargs_reach_only_their_tracker() -> None:
    a, b = RecordingTracker("a"), RecordingTracker("b")
    hub = TrackerHub.create([a, b])
    hub.init("run")
    hub.log({"x": 1}, step=3, log_kwargs={"a": {"commit": False}})
    hub.finish()
    assert a.logged() == [((3, {"commit": False}), {"x": 1})]
    assert b.logged() == [(3, {"x": 1})]


def test_values_are_copied_before_log_returns() -> None:
    gate = threading.Event()
    tracker = RecordingTracker("gated", gate=gate)
    hub = TrackerHub.create([tracker])
    hub.init("run")
    scalar = torch.tensor(1.0)
    vector = torch.arange(3.0)
    values = {"scalar": scalar, "vector": vector, "plain": 1}
    hub.log(values, step=0)
    # The training loop changes its tensors and dict before the worker gets to them.
    scalar.add_(100)
    vector.mul_(0)
    values["plain"] = 2
    gate.set()
    hub.finish()
    [(_, logged)] = tracker.logged()
    assert logged["scalar"] == 1.0 and isinstance(logged["scalar"], float)
    assert logged["vector"].tolist() == [0.0, 1.0, 2.0]
    assert logged["plain"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_cuda_tensors_are_copied_without_waiting_for_the_device() -> None:
    gate = threading.Event()
    tracker = RecordingTracker("gated", gate=gate)
    hub = TrackerHub.create([tracker])
    hub.init("run")
    loss = torch.full((), 3.0, device="cuda")
    grads = torch.ones(4, device="cuda")
    hub.log({"loss": loss, "grads": grads}, step=0)
    loss.add_(1)
    grads.zero_()
    gate.set()
    hub.finish()
    [(_, logged)] = tracker.logged()
    assert logged["loss"] == 3.0
    assert logged["grads"].device.type == "cpu" and logged["grads"].tolist() == [1.0] * 4


def test_a_hung_tracker_is_left_behind_with_a_warning() -> None:
    gate = threading.Event()
    hung = RecordingTracker("hung", gate=gate)
    fine = RecordingTracker("fine")
    hub = TrackerHub.create([hung, fine], timeout=0.5)
    hub.init("run")
    hub.log({"x": 1}, step=0)
    try:
        with pytest.warns(
            TrackerWarning, match=r"'hung' did not finish within 0.5 s \(busy in log"
        ):
            assert hub.finish() is False
        assert [kind for kind, _, _ in fine.calls] == ["start", "log", "finish"]
    finally:
        gate.set()


def test_non_main_process_creates_nothing_and_returns_stand_ins(tmp_path: Path) -> None:
    shared = RecordingTracker("everywhere", main_process_only=False)
    hub = TrackerHub.create(
        ["jsonl", "tensorboard", shared], logging_dir=str(tmp_path), is_main_process=False
    )
    hub.init("run", config={"a": 1})
    hub.log({"x": 1}, step=0)
    assert [t.name for t in hub.trackers] == ["everywhere"]
    stand_in = hub.get("tensorboard")
    assert isinstance(stand_in, NullTracker) and stand_in.name == "tensorboard"
    stand_in.log({"x": 1}, step=0)
    writer = hub.get("tensorboard", unwrap=True)
    writer.add_scalar("x", 1.0, global_step=0)  # a no-op, never an AttributeError
    writer.flush()
    hub.finish()
    assert not (tmp_path / "run").exists()
    assert shared.logged() == [(0, {"x": 1})]


def test_get_tracker_errors_name_the_trackers(tmp_path: Path) -> None:
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"No tracker named 'jsonl'.*init_trackers"):
        accelerator.get_tracker("jsonl")
    accelerator.init_trackers("run")
    with pytest.raises(ValueError, match=r"'wandb'.*\['jsonl'\]"):
        accelerator.get_tracker("wandb")
    assert accelerator.trackers[0].name == "jsonl"
    accelerator.end_training()


def test_log_before_init_and_without_trackers_is_a_no_op(tmp_path: Path) -> None:
    accelerator = Accelerator()
    accelerator.log({"x": 1}, step=0)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=0)
    accelerator.end_training()
    assert accelerator.trackers == []


def test_init_twice_is_refused_until_end_training(tmp_path: Path) -> None:
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    accelerator.init_trackers("first")
    with pytest.raises(RuntimeError, match=r"already called.*end_training"):
        accelerator.init_trackers("second")
    accelerator.log({"x": 1}, step=0)
    accelerator.end_training()
    accelerator.init_trackers("second")
    accelerator.log({"x": 2}, step=0)
    accelerator.end_training()
    assert read_jsonl(str(tmp_path / "first"))[0]["values"] == {"x": 1}
    assert read_jsonl(str(tmp_path / "second"))[0]["values"] == {"x": 2}


def test_non_numeric_values_are_converted_once_with_one_warning(tmp_path: Path) -> None:
    accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            accelerator.log({"loss": 1.0, "weird": {1, 2}, "nan": float("nan")}, step=step)
        accelerator.end_training()
    messages = [str(w.message) for w in caught if "'weird'" in str(w.message)]
    assert len([m for m in messages if "'jsonl'" in m]) == 1
    assert len([m for m in messages if "'tensorboard'" in m]) == 1
    records = read_jsonl(str(tmp_path / "run"))
    assert [r["values"]["weird"] for r in records] == [[1, 2]] * 3
    assert records[0]["values"]["nan"] == "nan" and records[0]["step"] == 0
    assert isinstance(records[0]["timestamp"], float)


def test_log_rejects_a_non_mapping(tmp_path: Path) -> None:
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    with pytest.raises(TypeError, match=r"dict of metric name -> value, got float"):
        accelerator.log(0.5, step=0)  # type: ignore[arg-type]
    accelerator.end_training()


class _HangsIn(GeneralTracker):
    """A custom tracker whose ``start``, ``store_init_configuration`` or ``log`` (of step 3)
    never returns."""

    requires_logging_directory = False

    def __init__(self, name: str, method: str, gate: threading.Event) -> None:
        super().__init__(run_name="")
        self.name = name  # type: ignore[misc]
        self.method = method
        self.gate = gate
        self.logged: list[Any] = []

    @property
    @override
    def tracker(self) -> None:
        return None

    @override
    def start(self) -> None:
        if self.method == "start":
            self.gate.wait()

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        if self.method == "store_init_configuration":
            self.gate.wait()

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self.method == "log" and step == 3:
            self.gate.wait()
        self.logged.append((step, values))


@pytest.mark.slow
@pytest.mark.parametrize("lazily", [False, True], ids=["in_init", "at_first_use"])
@pytest.mark.parametrize("method", ["start", "store_init_configuration"])
def test_a_hung_start_without_a_journal_is_bounded_reported_and_skipped(
    method: str, lazily: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "0.5")
    monkeypatch.setenv("ACCELKIT_TRACKER_JOURNAL", "0")  # nowhere to keep its values
    gate = threading.Event()
    hung = _HangsIn("hung", method, gate)
    try:
        config = ProjectConfiguration(project_dir=str(tmp_path), continue_tracker_runs=lazily)
        accelerator = Accelerator(log_with=[hung, "jsonl"], project_config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.monotonic()
            accelerator.init_trackers("run", config={"lr": 0.1})
            accelerator.log({"x": 1}, step=0)
            # Lazily opened runs are waited for (and a hung one reported) at the next wait.
            accelerator.end_training()
            waited = time.monotonic() - started
        reports = _tracker_warnings(caught)
        assert len(reports) == 1, reports
        assert f"'hung' failed in {method}()" in reports[0]
        assert "did not return within 0.5 s" in reports[0]
        assert "ACCELKIT_TRACKER_TIMEOUT" in reports[0]
        assert waited < 30  # bounded (generous: the machine is shared)
        assert [r["values"] for r in read_jsonl(str(tmp_path / "run"))] == [{"x": 1}]
    finally:
        gate.set()
    # Released late, the hung tracker stays skipped: it never receives values.
    time.sleep(0.2)
    assert hung.logged == []


@pytest.mark.slow
@pytest.mark.parametrize("lazily", [False, True], ids=["in_init", "at_first_use"])
@pytest.mark.parametrize("method", ["start", "store_init_configuration"])
def test_a_hung_start_with_a_journal_keeps_every_value(
    method: str, lazily: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#37 item 1: a backend whose start-up never returns (a client retrying a server that is
    down) is not skipped: the run ends after a bounded wait, what was logged is in its
    journal, named with the command that sends it, and sent once start() returns."""
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "0.5")
    gate = threading.Event()
    hung = _HangsIn("hung", method, gate)
    try:
        config = ProjectConfiguration(project_dir=str(tmp_path), continue_tracker_runs=lazily)
        accelerator = Accelerator(log_with=[hung, "jsonl"], project_config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.monotonic()
            accelerator.init_trackers("run", config={"lr": 0.1})
            for step in range(5):
                accelerator.log({"x": step}, step=step)
            accelerator.end_training()
            waited = time.monotonic() - started
        reports = _tracker_warnings(caught)
        assert reports and all("'hung' did not" in r for r in reports), reports
        assert not any("failed" in r or "skipped" in r for r in reports), reports
        journal = tmp_path / "accelkit-journal" / "hung"
        assert f"kept in its journal {journal}" in reports[-1]
        assert f"accelkit track sync {tmp_path} --tracker hung" in reports[-1]
        assert waited < 30  # bounded (generous: the machine is shared)
        assert [r["values"] for r in read_jsonl(str(tmp_path / "run"))] == [
            {"x": step} for step in range(5)
        ]
        assert hung.logged == []
    finally:
        gate.set()
    # Released late (the backend answers at last), it sends what its journal holds, once.
    deadline = time.monotonic() + 10
    while len(hung.logged) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert hung.logged == [(step, {"x": step}) for step in range(5)]


@pytest.mark.slow
def test_the_end_of_a_run_waits_the_drain_time_for_a_call_that_does_not_return(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend call that hangs in the middle of the run (a client retrying a server that
    went away) holds the end of the run for ``ACCELKIT_TRACKER_DRAIN_S``, not the tracker
    timeout (60 s here); the values behind it are journaled and sent, once, when it returns."""
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "0.5")
    gate = threading.Event()
    hung = _HangsIn("hung", "log", gate)
    try:
        accelerator = Accelerator(log_with=[hung], project_dir=str(tmp_path))
        accelerator.init_trackers("run")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(10):
                accelerator.log({"x": step}, step=step)
            started = time.monotonic()
            accelerator.end_training()
            waited = time.monotonic() - started
        reports = _tracker_warnings(caught)
        assert len(reports) == 1, reports
        assert "'hung' did not finish within 0.5 s (busy in log())" in reports[0]
        assert "ACCELKIT_TRACKER_DRAIN_S" in reports[0]
        assert f"accelkit track sync {tmp_path} --tracker hung" in reports[0]
        assert waited < 20, waited  # the drain time and a hung call's 2 s, not 60 s
        assert hung.logged == [(step, {"x": step}) for step in range(3)]
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while len(hung.logged) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert hung.logged == [(step, {"x": step}) for step in range(10)]


def test_a_hung_start_raises_with_the_raise_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    hub = TrackerHub.create([_HangsIn("hung", "start", gate)], on_error="raise", timeout=0.3)
    try:
        with pytest.raises(TrackerError, match=r"'hung' failed in start\(\).*within 0.3 s"):
            hub.init("run")
    finally:
        gate.set()
        hub.finish()


def test_every_tracker_failing_is_said_once_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = RecordingTracker("first", fail_in="start")
    second = RecordingTracker("second", fail_in="log")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        accelerator = Accelerator(log_with=[first, second])
        with caplog.at_level(logging.ERROR, logger="accelkit.trackers"):
            accelerator.init_trackers("run")
            assert caplog.records == []  # 'second' still works
            for step in range(3):
                accelerator.log({"x": step}, step=step)
            accelerator.end_training()
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert "'first', 'second'" in record.getMessage()
    assert "NOTHING IS BEING LOGGED" in record.getMessage()


def test_no_all_failed_report_while_one_tracker_works(caplog: pytest.LogCaptureFixture) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        accelerator = Accelerator(
            log_with=[RecordingTracker("broken", fail_in="start"), RecordingTracker("fine")]
        )
        with caplog.at_level(logging.ERROR, logger="accelkit.trackers"):
            accelerator.init_trackers("run")
            accelerator.log({"x": 1}, step=0)
            accelerator.end_training()
    assert caplog.records == []


def test_log_without_step_counts_calls_and_an_explicit_step_moves_the_count(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    recording = RecordingTracker("recording")
    accelerator = Accelerator(
        log_with=["tensorboard", "jsonl", recording], project_dir=str(tmp_path)
    )
    accelerator.init_trackers("run", config={"lr": 0.1})
    for value in (1.0, 2.0, 3.0):
        accelerator.log({"loss": value})
    accelerator.log({"loss": 10.0}, step=10)
    accelerator.log({"loss": 11.0})
    accelerator.log({"loss": 5.0}, step=5)  # a step set back is followed too
    accelerator.log({"loss": 6.0})
    accelerator.end_training()

    expected = [(0, 1.0), (1, 2.0), (2, 3.0), (10, 10.0), (11, 11.0), (5, 5.0), (6, 6.0)]
    jsonl, _ = readers.read_jsonl(str(tmp_path), "run")
    assert jsonl["loss"] == expected
    tensorboard, _ = readers.read_tensorboard(str(tmp_path), "run")
    assert tensorboard["loss"] == expected
    assert [step for step, _ in recording.logged()] == [step for step, _ in expected]


def test_each_run_counts_from_zero(tmp_path: Path) -> None:
    recording = RecordingTracker("recording")
    hub = TrackerHub.create([recording])
    for _ in range(2):
        hub.init("run")
        hub.log({"x": 1})
        hub.log({"x": 2})
        hub.finish()
    assert [step for step, _ in recording.logged()] == [0, 1, 0, 1]


def test_a_step_that_is_not_a_number_is_refused_by_log() -> None:
    hub = TrackerHub.create([RecordingTracker("recording")])
    hub.init("run")
    with pytest.raises(TypeError, match=r"log\(step='last'\).*int"):
        hub.log({"x": 1}, step="last")  # type: ignore[arg-type]
    hub.finish()


def test_an_accelerator_with_started_trackers_pickles_to_a_detached_copy(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.arange(8.0).reshape(8, 1), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1})

    copy = pickle.loads(pickle.dumps(accelerator))

    assert copy.state.__dict__ == accelerator.state.__dict__
    assert isinstance(copy.get_tracker("jsonl"), NullTracker)
    copy.log({"x": 99})  # a no-op: the copy has no trackers of its own
    with pytest.raises(RuntimeError, match="unpickled copy"):
        copy.init_trackers("run")
    # The original's trackers are untouched and go on.
    accelerator.log({"x": 2})
    accelerator.end_training()
    rows = read_jsonl(str(tmp_path / "run"))
    assert [(row["step"], row["values"]["x"]) for row in rows] == [(0, 1), (1, 2)]


def test_a_hub_pickles_before_init_and_keeps_its_step_count() -> None:
    hub = TrackerHub.create([RecordingTracker("recording")])
    hub.init("run")
    hub.log({"x": 1}, step=41)
    copy = pickle.loads(pickle.dumps(hub))
    hub.finish()
    assert copy.trackers == [] and copy.failures == []
    assert copy.last_step == 41  # the next log() without a step logs at 42
    assert copy.requested_names == ["recording"]
