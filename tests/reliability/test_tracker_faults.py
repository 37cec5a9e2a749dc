"""Tracker faults: a tracker that raises, one that hangs, and an MLflow server killed mid-run.

In each case the training loop runs to its end, the healthy trackers hold every step, the
failure is reported once (one ``TrackerWarning`` naming the tracker), and ``end_training``
returns (the hub's wait is bounded by ``ACCELKIT_TRACKER_TIMEOUT``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typing_extensions import override

from accelkit import Accelerator
from accelkit.trackers import GeneralTracker
from accelkit.trackers.backends.jsonl import read_jsonl
from accelkit.trackers.delivery.hub import TrackerWarning
from accelkit.trackers.delivery.sync import status
from tests.helpers.mlflow_server import MlflowServer

STEPS = 20


class _Recorder(GeneralTracker):
    """Keeps every logged step in memory."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__("", None)
        self.steps: list[int] = []

    @property
    @override
    def tracker(self) -> Any:
        return self.steps

    @override
    def start(self) -> None:
        pass

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        assert step is not None
        self.steps.append(step)


class _Raising(_Recorder):
    """Its backend breaks at step 3."""

    name = "raising"

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step == 3:
            raise ConnectionError("backend exploded")
        super().log(values, step)


class _Hanging(_Recorder):
    """Its backend never answers from step 3 on (until the test releases it)."""

    name = "hanging"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step == 3:
            self.release.wait(600)
        super().log(values, step)


def _train(accelerator: Accelerator, on_step: Any = None) -> int:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    done = 0
    for step in range(STEPS):
        loss = model(torch.randn(8, 4)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach(), "step_value": float(step)}, step=step)
        if on_step is not None:
            on_step(step)
        done += 1
    return done


def _end_bounded(accelerator: Accelerator) -> None:
    """``end_training`` in a thread; it must return (a generous bound, not a timing check)."""
    thread = threading.Thread(target=accelerator.end_training, daemon=True)
    thread.start()
    thread.join(300)
    assert not thread.is_alive(), "end_training() did not return: the hub waited forever"


def _reports(caught: list[warnings.WarningMessage], name: str) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, TrackerWarning) and repr(name) in str(w.message)
    ]


def test_raising_and_hanging_trackers_do_not_stop_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, summary: dict[str, Any]
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "3")
    raising, hanging, recorder = _Raising(), _Hanging(), _Recorder()
    accelerator = Accelerator(
        cpu=True, log_with=["jsonl", raising, hanging, recorder], project_dir=str(tmp_path)
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.init_trackers("faults", config={"lr": 0.1})
            assert _train(accelerator) == STEPS
            _end_bounded(accelerator)
    finally:
        hanging.release.set()
    assert recorder.steps == list(range(STEPS))
    records = read_jsonl(str(tmp_path / "faults"))
    assert [r["step"] for r in records] == list(range(STEPS))
    assert raising.steps == [0, 1, 2]
    raised = _reports(caught, "raising")
    assert len(raised) == 1 and "backend exploded" in raised[0], raised
    hung = _reports(caught, "hanging")
    # A journaled tracker stuck in one call is waited for the drain time (at most half the
    # timeout), not the whole timeout: its values are in its journal.
    assert len(hung) == 1 and "did not finish within 1.5 s" in hung[0], hung
    assert "ACCELKIT_TRACKER_DRAIN_S" in hung[0] and "accelkit track sync" in hung[0], hung
    assert not _reports(caught, "recorder") and not _reports(caught, "jsonl")
    summary["tracker_raises_and_tracker_hangs"] = {
        "trials": 1,
        "held": 1,
        "steps_logged_by_healthy_trackers": len(recorder.steps),
        "reports": {"raising": len(raised), "hanging": len(hung)},
    }


@pytest.mark.parametrize("journal", [False, True], ids=["no-journal", "journal"])
def test_hung_tracker_queue_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, summary: dict[str, Any], journal: bool
) -> None:
    """A backend hung for good does not make the hub hold values without limit: without a
    journal the waiting values are dropped and the tracker skipped; with one (the default) they
    go to the journal, the tracker is not skipped, and the end of the run says where they are."""
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "3")
    monkeypatch.setenv("ACCELKIT_TRACKER_MAX_PENDING", "300")
    monkeypatch.setenv("ACCELKIT_TRACKER_JOURNAL", "1" if journal else "0")
    hanging, recorder = _Hanging(), _Recorder()
    accelerator = Accelerator(cpu=True, log_with=[hanging, recorder], project_dir=str(tmp_path))
    steps = 2000
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.init_trackers("bounded")
            for step in range(steps):
                accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
                time.sleep(0.003)  # a training step: the hung call outlives the 3 s timeout
            _end_bounded(accelerator)
    finally:
        hanging.release.set()
    assert recorder.steps == list(range(steps))
    reports = _reports(caught, "hanging")
    if not journal:
        assert len(reports) == 1 and "values waiting" in reports[0], reports
        summary["tracker_hung_queue_bounded"] = {
            "trials": 1,
            "held": 1,
            "report": reports[0][:160],
        }
        return
    kept = [str(w.message) for w in caught if "kept in its journal" in str(w.message)]
    assert len(reports) == 1 and "did not finish" in reports[0], reports
    assert "kept in its journal" in reports[0] and "accelkit track sync" in reports[0]
    assert any("has not returned from log()" in m for m in kept), kept  # the bound, said once
    (row,) = [r for r in status(str(tmp_path)) if r.name == "hanging"]
    assert row.journaled == steps  # nothing dropped: every value is in the journal


# ------------------------------------------------------------------ MLflow server killed


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` on 127.0.0.1 in its own process group (the test kills it).

    Its store is a file store: a fresh sqlite store costs a minute of migrations here."""
    pytest.importorskip("mlflow")
    root = tmp_path / "mlflow-server"
    server = MlflowServer(root, (root / "mlruns").as_uri())
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_mlflow_server_killed_mid_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_server: MlflowServer,
    summary: dict[str, Any],
) -> None:
    url, database = mlflow_server.url, mlflow_server.root / "mlruns"
    # MLflow's own client retries a dead server for minutes by default (7 retries with
    # exponential backoff); with 1 retry the failure surfaces as an error within seconds.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "60")
    # The dead server never answers: end_training gives up on it after 1 s of retries, not the
    # default drain time of 10 s (ACCELKIT_TRACKER_DRAIN_S), which only made the test wait.
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "1")
    recorder = _Recorder()
    accelerator = Accelerator(
        cpu=True, log_with=["mlflow", "jsonl", recorder], project_dir=str(tmp_path)
    )
    killed_at = 9

    def kill_server(step: int) -> None:
        if step == killed_at:
            accelerator.get_tracker("mlflow")  # flushes: steps 0..9 have reached the server
            mlflow_server.kill()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.init_trackers(
            "killed", config={"lr": 0.1}, init_kwargs={"mlflow": {"tracking_uri": url}}
        )
        assert _train(accelerator, kill_server) == STEPS
        _end_bounded(accelerator)

    assert recorder.steps == list(range(STEPS))
    assert [r["step"] for r in read_jsonl(str(tmp_path / "killed"))] == list(range(STEPS))
    reports = _reports(caught, "mlflow")
    # With the tracker journal (#27) the dead server is retried, not dropped: one report for
    # the outage, and one for finish(), which cannot mark the run finished on a dead server.
    assert len(reports) in (1, 2) and "retried with backoff" in reports[0], reports
    assert all("failed in finish()" in report for report in reports[1:]), reports
    # The server's store holds exactly the steps logged before it died; the rest wait in the
    # journal for `accelkit track sync`.
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=database.as_uri())
    experiment = client.get_experiment_by_name("killed")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(killed_at + 1))
    summary["mlflow_server_killed_mid_run"] = {
        "trials": 1,
        "held": 1,
        "steps_in_mlflow_before_kill": len(history),
        "steps_in_other_trackers": len(recorder.steps),
        "reports": len(reports),
        "report": reports[0][:200],
    }
