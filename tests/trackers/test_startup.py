"""Trackers that start slowly (issue #30, item 4): the first ``save_state()`` does not wait for a
tracker still opening its run, and experiment continuity still resumes that run.

The checkpoint saved while a run is opening lists the tracker in ``experiment.pending``; when
the run opens, its manifest is rewritten with the reference. A real slow tracker (a custom
``GeneralTracker`` whose ``start()`` waits) and a real ``mlflow server`` behind a TCP proxy that
holds the client's requests (a server answering slowly) show it, in both call orders; a job
killed before its run opened resumes into a new run and says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, ProjectConfiguration
from tests.trackers.conftest import OFFLINE_ENV
from tests.trackers.custom import SlowStartTracker


def _manifest(project: Path, number: int = 0) -> dict[str, Any]:
    path = project / "checkpoints" / f"checkpoint_{number}" / "accelkit.json"
    experiment: dict[str, Any] = json.loads(path.read_text())["experiment"]
    return experiment


def _accelerator(project: Path, tracker: Any) -> Accelerator:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    return Accelerator(log_with=tracker, project_config=config)


def _points(folder: Path, run_id: str) -> list[tuple[int, float]]:
    lines = (folder / f"{run_id}.txt").read_text().split("\n")
    rows = [line.split() for line in lines if line]
    return [(int(step), float(value)) for step, key, value in rows if key == "x"]


@pytest.mark.parametrize("order", ["init-first", "load-first"])
def test_save_state_does_not_wait_for_a_slow_start_and_the_run_continues(
    tmp_path: Path, order: str
) -> None:
    project, runs = tmp_path / "project", tmp_path / "runs"
    gate = threading.Event()
    tracker = SlowStartTracker(str(runs), gate=gate)
    accelerator = _accelerator(project, tracker)
    accelerator.init_trackers("run")
    for step in range(3):
        accelerator.log({"x": float(step)}, step=step)
    accelerator.save_state()
    # save_state returned while start() was still blocked: it did not wait for the run.
    assert not tracker.started.is_set()
    assert _manifest(project) == {"step": 2, "runs": {}, "pending": ["slow_start"]}

    gate.set()  # the backend answers: the run opens, the committed record is completed
    accelerator.wait_for_checkpoints()
    assert tracker.started.is_set() and tracker.run_id is not None
    first = tracker.run_id
    assert _manifest(project) == {"step": 2, "runs": {"slow_start": {"run_id": first}}}
    accelerator.log({"x": 99.0}, step=3)  # after the checkpoint: replaced by the resumed job
    accelerator.end_training()

    # A new job resumes from the checkpoint, in either call order, and continues the run.
    again = SlowStartTracker(str(runs))
    resumed = _accelerator(project, again)
    if order == "init-first":
        resumed.init_trackers("run")
    resumed.load_state()
    if order == "load-first":
        resumed.init_trackers("run")
    for step in range(3, 5):
        resumed.log({"x": float(step)}, step=step)
    resumed.end_training()
    assert again.continued == {"run_id": first} and again.run_id == first
    assert _points(runs, first) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 99.0), (3, 3.0), (4, 4.0)]


def test_a_fast_tracker_is_recorded_at_once_and_end_training_completes_pending_records(
    tmp_path: Path,
) -> None:
    """A run that is already open goes into the manifest as before (nothing pending); a save
    right before ``end_training`` still gets its record (``end_training`` waits for it)."""
    project, runs = tmp_path / "project", tmp_path / "runs"
    tracker = SlowStartTracker(str(runs))  # no gate: opens at once
    accelerator = _accelerator(project, tracker)
    accelerator.init_trackers("run")
    accelerator.log({"x": 0.0}, step=0)
    accelerator.get_tracker("slow_start")  # waits for the run to open
    accelerator.save_state()
    assert _manifest(project, 0) == {"step": 0, "runs": {"slow_start": {"run_id": tracker.run_id}}}

    gate = threading.Event()
    slow = SlowStartTracker(str(runs), gate=gate)
    accelerator = _accelerator(tmp_path / "other", slow)
    accelerator.init_trackers("run")
    accelerator.log({"x": 0.0}, step=0)
    accelerator.save_state()
    assert _manifest(tmp_path / "other")["pending"] == ["slow_start"]
    threading.Timer(0.5, gate.set).start()
    accelerator.end_training()
    assert _manifest(tmp_path / "other") == {
        "step": 0,
        "runs": {"slow_start": {"run_id": slow.run_id}},
    }


_KILLED_JOB = """
import os, signal, sys, threading
from accelkit import Accelerator, ProjectConfiguration
from tests.trackers.custom import SlowStartTracker
project, runs = sys.argv[1], sys.argv[2]
tracker = SlowStartTracker(runs, gate=threading.Event(), limit=600)  # never opens
config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
accelerator = Accelerator(log_with=tracker, project_config=config)
accelerator.init_trackers("run")
accelerator.log({"x": 0.0}, step=0)
accelerator.save_state()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_job_killed_before_its_run_opened_resumes_into_a_new_run_and_says_so(
    tmp_path: Path,
) -> None:
    project, runs = tmp_path / "project", tmp_path / "runs"
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_JOB, str(project), str(runs)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    # The checkpoint is whole; its record says which run was never known.
    assert _manifest(project) == {"step": 0, "runs": {}, "pending": ["slow_start"]}

    again = SlowStartTracker(str(runs))
    resumed = _accelerator(project, again)
    resumed.init_trackers("run")
    with pytest.warns(UserWarning, match=r"runs of \['slow_start'\] were still opening"):
        resumed.load_state()
    resumed.log({"x": 1.0}, step=1)
    resumed.end_training()
    assert again.continued is None and again.run_id is not None  # a new run
    assert _points(runs, again.run_id) == [(1, 1.0)]


# ------------------------------------------------------------------ a real MLflow server


class HeldProxy:
    """A TCP proxy on 127.0.0.1 to ``port`` that holds every connection until ``release()``:
    a server that answers slowly (as a loaded MLflow server does), without touching it."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.gate = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if not self.gate.is_set():
            self.held += 1
        self.gate.wait(120)
        upstream = socket.create_connection(("127.0.0.1", self.target))

        def pipe(source: socket.socket, sink: socket.socket) -> None:
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                for end in (source, sink):
                    try:
                        end.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)


@pytest.mark.slow
def test_mlflow_server_slow_to_open_the_run_save_does_not_wait_and_the_run_continues(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    proxy = HeldProxy(int(mlflow_server.rsplit(":", 1)[1]))
    experiment = f"startup-{tmp_path.name}"
    project = tmp_path / "project"
    try:
        accelerator = _accelerator(project, "mlflow")
        accelerator.init_trackers(experiment, init_kwargs={"mlflow": {"tracking_uri": proxy.url}})
        for step in range(3):
            accelerator.log({"x": float(step)}, step=step)
        began = time.perf_counter()
        accelerator.save_state()
        blocked = time.perf_counter() - began
        # The save returned while the server had not answered a single request of the start.
        assert not proxy.gate.is_set() and proxy.held >= 1
        assert _manifest(project) == {"step": 2, "runs": {}, "pending": ["mlflow"]}

        proxy.release()
        accelerator.wait_for_checkpoints()
        record = _manifest(project)
        assert "pending" not in record
        run_id = record["runs"]["mlflow"]["run_id"]
        accelerator.end_training()

        resumed = _accelerator(project, "mlflow")
        resumed.load_state()  # load first, then init: the other order of the test above
        resumed.init_trackers(experiment, init_kwargs={"mlflow": {"tracking_uri": proxy.url}})
        for step in range(3, 5):
            resumed.log({"x": float(step)}, step=step)
        resumed.end_training()
    finally:
        proxy.release()
        proxy.close()

    client = MlflowClient(tracking_uri=mlflow_server)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    (run,) = client.search_runs([found.experiment_id])
    assert run.info.run_id == run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "x"))
    assert history == [(s, float(s)) for s in range(5)]
    # The save-time event measured the save only, not the start it no longer waits for.
    (saved,) = client.get_metric_history(run_id, "checkpoint/blocking_seconds")
    assert saved.value <= blocked
