"""Trackers that start slowly (issue #30, item 4; issue #37, items 2 and 7e): the first
``save_state()`` does not wait for a tracker still opening its run, and the checkpoint names
that run all the same.

Each run has a key chosen by accelkit (``TrackerHub.run_key``); each tracker maps it to its
backend's run before opening it (``GeneralTracker.name_run``: W&B's run id, Comet's experiment
key, an MLflow run tag), so the manifest is written once, complete, at the commit: no
``pending`` entry, no rewrite, and a job killed before any backend answered resumes into the same
runs. A real slow tracker (a custom ``GeneralTracker`` whose ``start()`` waits), a real ``mlflow
server`` behind a TCP proxy that holds the client's requests, and a job logging to W&B, Comet
and MLflow whose backends never answer before it is killed show it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, ProjectConfiguration
from accelkit.cli.main import main as cli
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job
from tests.trackers.custom import SlowStartTracker, by_name
from tests.trackers.test_continuity_wandb_comet import _comet_archives

KEY = re.compile(r"[0-9a-f]{32}")


def _manifest_path(project: Path, number: int = 0) -> Path:
    return project / "checkpoints" / f"checkpoint_{number}" / "accelkit.json"


def _manifest(project: Path, number: int = 0) -> dict[str, Any]:
    """The checkpoint's ``experiment`` record, less ``saved_at_step`` (where its events go,
    tested in ``test_continuity_core``): these tests are about how its runs are named."""
    experiment: dict[str, Any] = json.loads(_manifest_path(project, number).read_text())[
        "experiment"
    ]
    experiment.pop("saved_at_step", None)
    return experiment


def _accelerator(project: Path, tracker: Any, **options: Any) -> Accelerator:
    """An Accelerator logging to ``tracker``; a slow tracker is named in ``log_with`` (an
    instance would be started, and waited for, by ``init_trackers``, as Accelerate does)."""
    config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, **options
    )
    if isinstance(tracker, SlowStartTracker):
        tracker = by_name(tracker)
    return Accelerator(log_with=tracker, project_config=config)


def _points(folder: Path, run_id: str) -> list[tuple[int, float]]:
    lines = (folder / f"{run_id}.txt").read_text().split("\n")
    rows = [line.split() for line in lines if line]
    return [(int(step), float(value)) for step, key, value in rows if key == "x"]


@pytest.mark.parametrize("order", ["init-first", "load-first"])
def test_save_state_does_not_wait_for_a_slow_start_and_names_the_run(
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
    # save_state returned while start() was still blocked, and the manifest names the run
    # start() is opening: the one of the run key.
    assert not tracker.started.is_set()
    record = _manifest(project)
    key = record["key"]
    assert KEY.fullmatch(key) and record == {"step": 2, "key": key, "runs": {"slow_start": {
        "run_id": key}}}  # fmt: skip
    written = _manifest_path(project).read_bytes()

    gate.set()  # the backend answers: the run opens; the manifest is not written again
    accelerator.wait_for_checkpoints()
    assert tracker.started.wait(30) and tracker.run_id == key
    accelerator.log({"x": 99.0}, step=3)  # after the checkpoint: replaced by the resumed job
    accelerator.end_training()
    assert _manifest_path(project).read_bytes() == written

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
    resumed.save_state()
    resumed.end_training()
    assert again.continued == {"run_id": key} and again.run_id == key
    assert _points(runs, key) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 99.0), (3, 3.0), (4, 4.0)]
    # The resumed job keeps the run key: its checkpoints name the same run.
    loaded = {"tier": "local", "checkpoint": "checkpoint_0", "step": 0}
    assert _manifest(project, 1) == {"step": 4, "key": key, "runs": {"slow_start": {
        "run_id": key}}, "resumed": loaded}  # fmt: skip


def test_a_tracker_that_cannot_name_its_run_is_recorded_once_open(tmp_path: Path) -> None:
    """A tracker without ``name_run`` (the default: Accelerate's custom trackers) is named
    in the checkpoints saved after its run opened, never by rewriting an earlier one."""
    from tests.trackers.custom import CSVTracker

    project = tmp_path / "project"
    tracker = CSVTracker("run", str(tmp_path / "csv"))
    assert tracker.name_run("0" * 32) is None
    accelerator = _accelerator(project, tracker)
    accelerator.init_trackers("run")
    accelerator.log({"x": 0.0}, step=0)
    accelerator.save_state()
    record = _manifest(project)
    assert KEY.fullmatch(record["key"]) and record["runs"] == {} and "pending" not in record
    accelerator.end_training()


_KILLED_JOB = """
import os, signal, sys, threading
from accelkit import Accelerator, ProjectConfiguration
from tests.trackers.custom import SlowStartTracker, by_name
project, runs = sys.argv[1], sys.argv[2]
tracker = SlowStartTracker(runs, gate=threading.Event(), limit=600)  # never opens
config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
accelerator = Accelerator(log_with=by_name(tracker), project_config=config)
accelerator.init_trackers("run")
accelerator.log({"x": 0.0}, step=0)
accelerator.save_state()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_job_killed_before_its_run_opened_resumes_into_the_same_run(
    tmp_path: Path, jobs: Preloaded
) -> None:
    project, runs = tmp_path / "project", tmp_path / "runs"
    done = run_job(jobs, "-c", _KILLED_JOB, str(project), str(runs), timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    # The checkpoint is whole and names the run that never opened.
    record = _manifest(project)
    key = record["key"]
    assert record == {"step": 0, "key": key, "runs": {"slow_start": {"run_id": key}}}

    again = SlowStartTracker(str(runs))
    resumed = _accelerator(project, again)
    resumed.init_trackers("run")
    resumed.load_state()
    resumed.log({"x": 1.0}, step=1)
    resumed.end_training()
    assert again.continued == {"run_id": key} and again.run_id == key
    assert _points(runs, key) == [(1, 1.0)]


_STALLED_BACKENDS_JOB = """
import os, signal, sys, threading
import comet_ml, wandb
from mlflow import MlflowClient

never, created = threading.Event(), threading.Event()

def stalled(*args, **kwargs):  # a backend that has not answered when the job is killed
    never.wait()

def create_then_stall(self, *args, **kwargs):  # the run is made; the answer comes too late
    made = create_run(self, *args, **kwargs)
    created.set()
    never.wait()
    return made

wandb.init = stalled
comet_ml.start = stalled
create_run, MlflowClient.create_run = MlflowClient.create_run, create_then_stall

from accelkit import Accelerator, ProjectConfiguration
config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
accelerator = Accelerator(log_with=["wandb", "comet_ml", "mlflow"], project_config=config)
accelerator.init_trackers("run")
for step in range(3):
    accelerator.log({"loss": float(step)}, step=step)
assert created.wait(120)
accelerator.save_state()
os.kill(os.getpid(), signal.SIGKILL)
"""

_RESUMED_JOB = """
import json, sys
from accelkit import Accelerator, ProjectConfiguration
config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
accelerator = Accelerator(log_with=["wandb", "comet_ml", "mlflow"], project_config=config)
accelerator.init_trackers("run")
accelerator.load_state()
for step in range(3, 5):
    accelerator.log({"loss": float(step)}, step=step)
runs = {tracker.name: tracker.run_reference() for tracker in accelerator.trackers}
accelerator.end_training()
print("RESULT " + json.dumps(runs))
"""


@pytest.mark.slow
def test_a_job_killed_before_wandb_comet_and_mlflow_answered_resumes_into_the_same_runs(
    tmp_path: Path, mlflow_template_db: Path, jobs: Preloaded
) -> None:
    """Issue #37 item 2, with the real packages (W&B and Comet offline, MLflow on sqlite): the
    job is killed right after its first save, while ``wandb.init`` and ``comet_ml.start`` have
    not returned and MLflow has created the run but not answered. The checkpoint already
    names the three runs by the run key; the resumed job opens the same W&B run id and Comet
    experiment key and finds the MLflow run by its tag (no second run)."""
    from mlflow import MlflowClient

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(mlflow_template_db, project / "mlflow.db")  # the tracker's default store

    def job(script: str) -> subprocess.CompletedProcess[str]:
        # Comet's message folder of the killed job stays behind, in the fixture's TMPDIR.
        return run_job(jobs, "-c", script, str(project), timeout=300, cwd=tmp_path)

    killed = job(_STALLED_BACKENDS_JOB)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]
    record = _manifest(project)
    key = record["key"]
    assert KEY.fullmatch(key) and record["step"] == 2 and "pending" not in record
    runs = record["runs"]
    assert runs["wandb"] == {"run_id": key, "project": "run"}
    assert runs["comet_ml"] == {"experiment_key": key, "project": "run"}
    assert (runs["mlflow"]["run_key"], runs["mlflow"]["experiment_name"]) == (key, "run")
    assert not list(project.glob("wandb/offline-run-*"))  # W&B never opened its run

    resumed = job(_RESUMED_JOB)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    (line,) = [x for x in resumed.stdout.splitlines() if x.startswith("RESULT ")]
    opened = json.loads(line[len("RESULT ") :])
    assert opened["wandb"]["run_id"] == key
    assert opened["comet_ml"]["experiment_key"] == key
    (folder,) = project.glob("wandb/offline-run-*")
    assert folder.name.endswith(f"-{key}") and (folder / f"run-{key}.wandb").exists()
    ((name, meta, _),) = _comet_archives(project)  # the killed job never wrote one
    assert name.startswith(key) and meta is not None and meta["offline_id"] == key

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("run")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # the killed job's, continued
    assert run.info.run_id == opened["mlflow"]["run_id"]
    assert run.data.tags["accelkit.run_key"] == key
    assert run.data.tags["accelkit.resumed_at_step"] == "2"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == [(3, 3.0), (4, 4.0)]


def test_a_checkpoint_from_before_run_keys_with_pending_runs_still_loads(tmp_path: Path) -> None:
    """A manifest written before run keys (no ``key``; a run still opening listed in
    ``pending``) is read: that tracker opens a new run, with a warning, and the next
    checkpoint names it with a key."""
    project, runs = tmp_path / "project", tmp_path / "runs"
    accelerator = _accelerator(project, SlowStartTracker(str(runs)))
    accelerator.init_trackers("run")
    accelerator.log({"x": 0.0}, step=0)
    accelerator.save_state()
    accelerator.end_training()
    path = _manifest_path(project)
    manifest = json.loads(path.read_text())
    manifest["experiment"] = {"step": 0, "runs": {}, "pending": ["slow_start"]}
    path.write_text(json.dumps(manifest))

    again = SlowStartTracker(str(runs))
    resumed = _accelerator(project, again)
    resumed.init_trackers("run")
    with pytest.warns(UserWarning, match=r"runs of \['slow_start'\] were still opening"):
        resumed.load_state()
    resumed.log({"x": 1.0}, step=1)
    resumed.save_state()
    resumed.end_training()
    assert again.continued is None and again.run_id is not None  # a new run
    assert _points(runs, again.run_id) == [(1, 1.0)]
    record = _manifest(project, 1)
    loaded = {"tier": "local", "checkpoint": "checkpoint_0", "step": 0}
    assert record == {"step": 1, "key": again.run_id, "runs": {"slow_start": {
        "run_id": again.run_id}}, "resumed": loaded}  # fmt: skip


@pytest.mark.slow
def test_prune_while_a_run_opens_leaves_no_manifest_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #37 item 7e: the manifest was rewritten when a run opened, outside the project's
    lock, so an ``accelkit ckpt prune`` in that window left a ``checkpoint_0`` holding only
    ``accelkit.json``. No manifest is written after the commit any more: a prune while the
    run is opening deletes the checkpoint for good, and the one kept is never touched."""
    project, runs = tmp_path / "project", tmp_path / "runs"
    gate = threading.Event()
    tracker = SlowStartTracker(str(runs), gate=gate)
    accelerator = _accelerator(project, tracker)
    accelerator.init_trackers("run")
    accelerator.log({"x": 0.0}, step=0)
    accelerator.save_state()
    accelerator.log({"x": 1.0}, step=1)
    accelerator.save_state()
    kept = _manifest_path(project, 1).read_bytes()
    assert not tracker.started.is_set()
    assert cli(["ckpt", "prune", str(project), "--keep", "1", "--yes"]) == 0, capsys.readouterr()
    gate.set()  # the run opens after the prune
    accelerator.end_training()
    assert tracker.run_id == _manifest(project, 1)["key"]
    assert not (project / "checkpoints" / "checkpoint_0").exists()
    assert _manifest_path(project, 1).read_bytes() == kept
    assert cli(["ckpt", "prune", str(project), "--keep", "1", "--yes"]) == 0
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_1"]


@pytest.mark.slow
def test_the_remote_tier_names_the_same_runs_and_resumes_into_them(tmp_path: Path) -> None:
    """Issue #37 item 2: a checkpoint replicated while its run was opening kept ``pending`` on
    the remote tier for good. The remote copy now says what the local one says, and a job
    resumed from the remote tier alone continues the run."""
    project, remote, runs = tmp_path / "project", tmp_path / "remote", tmp_path / "runs"
    gate = threading.Event()
    tracker = SlowStartTracker(str(runs), gate=gate)
    accelerator = _accelerator(project, tracker, replicate_to=str(remote))
    accelerator.init_trackers("run")
    accelerator.log({"x": 0.0}, step=0)
    accelerator.save_state()
    assert accelerator._checkpoints.wait_replicated(60)
    assert not tracker.started.is_set()  # replicated before the run opened
    local = _manifest(project)
    assert _manifest(remote) == local and local["runs"] == {"slow_start": {"run_id": local["key"]}}
    gate.set()
    accelerator.end_training()
    assert _manifest(remote) == local

    shutil.rmtree(project)  # a new machine: only the remote tier is left
    again = SlowStartTracker(str(runs))
    resumed = _accelerator(project, again, replicate_to=str(remote))
    resumed.init_trackers("run")
    assert resumed.load_state().startswith(str(remote))
    resumed.log({"x": 1.0}, step=1)
    resumed.end_training()
    assert again.run_id == tracker.run_id == local["key"]
    assert _points(runs, local["key"]) == [(0, 0.0), (1, 1.0)]


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
        # The start's first request is in flight (held) before the save; on a loaded machine
        # the tracker's thread may not have sent it yet when the logs return.
        deadline = time.monotonic() + 60
        while proxy.held < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        began = time.perf_counter()
        accelerator.save_state()
        blocked = time.perf_counter() - began
        # The save returned while the server had not answered a single request of the start,
        # and the manifest names the run by its key, once and for all.
        assert not proxy.gate.is_set() and proxy.held >= 1
        record = _manifest(project)
        key = record["key"]
        assert record == {"step": 2, "key": key, "runs": {"mlflow": {
            "run_key": key, "experiment_name": experiment, "tracking_uri": proxy.url}}}  # fmt: skip
        written = _manifest_path(project).read_bytes()

        proxy.release()
        accelerator.wait_for_checkpoints()
        run_id = accelerator.get_tracker("mlflow").run_id
        accelerator.end_training()
        assert _manifest_path(project).read_bytes() == written

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
    (run,) = client.search_runs([found.experiment_id])  # found again by its key: one run
    assert run.info.run_id == run_id and run.data.tags["accelkit.run_key"] == key
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "x"))
    assert history == [(s, float(s)) for s in range(5)]
    # The save-time event measured the save only, not the start it no longer waits for.
    (saved,) = client.get_metric_history(run_id, "checkpoint/blocking_seconds")
    assert saved.value <= blocked
