"""The tracker journal against a real ``mlflow server`` that goes away (#27's acceptance, short).

The long version (2 processes, 10,000 points, a 60 s outage, throughput compared) is
``tests/reliability/soak_journal.py``; these keep a real server killed and restarted on the same
sqlite store, and a ``kill -9`` of ``accelkit track sync`` in the middle of its replay.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from accelkit import Accelerator
from accelkit.trackers import TrackerWarning
from tests.helpers.mlflow_server import MlflowServer
from tests.trackers.conftest import OFFLINE_ENV, job_env

pytestmark = pytest.mark.slow

# MLflow's client retries a refused connection for minutes by default; the journal retries.
_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def _server(root: Path, template: Path) -> MlflowServer:
    """A server on a fixed port and sqlite store, which a test kills and restarts."""
    root.mkdir()
    shutil.copy(template, root / "mlflow.db")
    return MlflowServer(root, f"sqlite:///{root / 'mlflow.db'}", env={**os.environ, **OFFLINE_ENV})


@pytest.fixture
def server(tmp_path: Path, mlflow_template_db: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for key, value in _CLIENT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.5")
    running = _server(tmp_path / "server", mlflow_template_db)
    running.start(timeout=120)
    yield running
    running.kill()


def _history(url: str, name: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url)
    (experiment,) = [e for e in client.search_experiments() if e.name == name]
    (run,) = client.search_runs([experiment.experiment_id])
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "x"))


def _left_by_dead_clients(port: int) -> int:
    """The server's connections on ``port`` whose client has closed its end (CLOSE_WAIT, from
    ``/proc/net/tcp``): requests the server has still to read, answer or drop."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            count += int(local.rsplit(":", 1)[1], 16) == port and state == "08"
    return count


def _wait_for_run(url: str, port: int, name: str, seconds: float = 10) -> None:
    """Wait until experiment ``name`` has a run, or until the server holds no connection of a
    client that is gone (and 1 s more, for a request it may still be handling); at most
    ``seconds``. Waiting for the run alone took the whole 10 s whenever the dead job's pending
    request created none (here, every time: it was start()'s first, a lookup)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url)
    deadline = time.monotonic() + seconds
    settled: float | None = None
    while time.monotonic() < deadline and (settled is None or time.monotonic() < settled):
        if settled is None and not _left_by_dead_clients(port):
            settled = time.monotonic() + 1
        found = [e for e in client.search_experiments() if e.name == name]
        if found and client.search_runs([found[0].experiment_id]):
            return
        time.sleep(0.2)


def _times(url: str, name: str) -> dict[int, float]:
    """Step -> the wall time (s) MLflow recorded for metric ``x`` of run ``name``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url)
    (experiment,) = [e for e in client.search_experiments() if e.name == name]
    (run,) = client.search_runs([experiment.experiment_id])
    return {m.step: m.timestamp / 1000 for m in client.get_metric_history(run.info.run_id, "x")}


def _acked(path: Path) -> int:
    """The last delivered entry (the first line of the journal's ``acked`` file)."""
    text = path.read_text() if path.exists() else ""
    return int(text.split()[0]) if text.strip() else -1


def _accelerator(folder: Path, url: str) -> Accelerator:
    accelerator = Accelerator(log_with=["mlflow", "jsonl"], project_dir=str(folder / "project"))
    accelerator.init_trackers(folder.name, init_kwargs={"mlflow": {"tracking_uri": url}})
    return accelerator


def test_an_mlflow_outage_is_caught_up_and_synced_exactly_once(
    server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One server (each start costs 15-40 s here), killed once during three runs: the first
    outlives the outage and catches up; the third starts during it (its ``start()`` is
    retried) and catches up too, every replayed point with the wall time it was logged at;
    the second ends during it, and ``accelkit track sync`` delivers its points, killed with
    ``kill -9`` in the middle of its replay and run again."""
    first = _accelerator(tmp_path / "first", server.url)
    # The run that ends during the outage gives up delivering at once (the others keep the
    # default drain time, for their catch-up once the server is back).
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "0.5")
    second = _accelerator(tmp_path / "second", server.url)
    monkeypatch.delenv("ACCELKIT_TRACKER_DRAIN_S")
    for step in range(50):
        first.log({"x": float(step)}, step=step)
    second.log({"x": 0.0}, step=0)
    first.get_tracker("mlflow")  # flushed: the server has steps 0-49 and 0
    second.get_tracker("mlflow")
    server.kill()
    points = 600
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        third = _accelerator(tmp_path / "third", server.url)  # its start() fails: retried
        for step in range(50, 150):
            first.log({"x": float(step)}, step=step)
            third.log({"x": float(step)}, step=step)
            time.sleep(0.002)
        for step in range(1, points):
            second.log({"x": float(step)}, step=step)
        second.end_training()  # during the outage: its points stay journaled
        first._trackers.flush()  # journaled (with their times), not delivered
        third._trackers.flush()
        restarted = time.time()
        server.start(timeout=120)  # the same store, the same port
        for step in range(150, 200):
            first.log({"x": float(step)}, step=step)
            third.log({"x": float(step)}, step=step)
        first.end_training()
        third.end_training()
    # 1. The runs that outlived the outage, or began in it, caught up: every point once,
    # those of the outage with the wall time they were logged at (before the restart).
    assert _history(server.url, "first") == [(s, float(s)) for s in range(200)]
    assert _history(server.url, "third") == [(s, float(s)) for s in range(50, 200)]
    for name in ("first", "third"):
        times = _times(server.url, name)
        during = [times[step] for step in range(50, 150)]
        assert max(during) < restarted and during == sorted(during), name
        assert min(times[step] for step in range(150, 200)) > restarted, name
    reports = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    retried = [r for r in reports if "retried with backoff" in r]
    assert len(retried) == 3, "\n".join(reports)  # once per run
    assert len([r for r in retried if "failed in start()" in r]) == 1, retried
    # The run that ended during the outage did not ask the server to finish its MLflow run
    # (sync does): nothing else was said.
    assert [r for r in reports if r not in retried] == []
    assert _history(server.url, "second") == [(0, 0.0)]

    # 2. `accelkit track sync` for the other, killed -9 in the middle of its replay, run again.
    project = tmp_path / "second" / "project"
    acked = project / "accelkit-journal" / "mlflow" / "acked"
    command = [sys.executable, "-m", "accelkit.cli.main", "track", "sync", str(project)]
    env = job_env(**_CLIENT_ENV, PYTHONPATH=os.getcwd())
    sync = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while _acked(acked) < 150:
        assert sync.poll() is None, sync.communicate()[0].decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    sync.send_signal(signal.SIGKILL)
    sync.wait()
    assert 150 <= _acked(acked) < points  # some sent, some left
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 pending" in done.stdout
    assert _history(server.url, "second") == [(s, float(s)) for s in range(points)]


_DOWN_FROM_THE_START = """
import sys, time
from accelkit import Accelerator
accelerator = Accelerator(log_with=["mlflow", "jsonl"], project_dir=sys.argv[1])
accelerator.init_trackers(sys.argv[4], init_kwargs={"mlflow": {"tracking_uri": sys.argv[2]}})
for step in range(int(sys.argv[3])):
    accelerator.log({"x": float(step)}, step=step)
    time.sleep(0.01)
ended = time.monotonic()
accelerator.end_training()
print(f"end_training took {time.monotonic() - ended:.1f} s", flush=True)
"""


def test_an_mlflow_server_down_from_the_start_loses_no_point(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    """#37 item 1, with MLflow's own client settings (it retries a refused connection for
    minutes inside ``start()``, and waits on a paused server): every point is journaled, the
    job ends within the drain time of its loop (``ACCELKIT_TRACKER_DRAIN_S``: 3 s here, not
    the default 10, whose only cost would be two jobs' 7 s more of waiting), and
    ``accelkit track sync`` sends every point, into one run, once the server answers. First
    with nothing listening, then with the server paused (SIGSTOP) rather than refusing."""
    server = _server(tmp_path / "server", mlflow_template_db)  # nothing listens there yet
    script = tmp_path / "job.py"
    script.write_text(_DOWN_FROM_THE_START)
    points = 200
    env = job_env(PYTHONPATH=os.getcwd(), ACCELKIT_TRACKER_DRAIN_S="3")
    for key in _CLIENT_ENV:
        env.pop(key, None)

    def job(name: str) -> Path:
        project = tmp_path / name
        done = subprocess.run(
            [sys.executable, str(script), str(project), server.url, str(points), name],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        took = float(output.split("end_training took ")[1].split(" s")[0])
        assert took < 8, output  # 3 s of drain, not MLflow's minutes of retries
        assert "failed" not in output and "NOTHING IS BEING LOGGED" not in output, output
        assert f"accelkit track sync {project} --tracker mlflow" in output, output
        status = subprocess.run(
            [sys.executable, "-m", "accelkit.cli.main", "track", "status", str(project)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert f"mlflow: {points} journaled, 0 delivered, {points} pending" in status.stdout, (
            status.stdout + status.stderr
        )
        return project

    def sync(project: Path) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "accelkit.cli.main", "track", "sync", str(project)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    down = job("down")
    try:
        server.start(timeout=120)
        sync(down)
        assert _history(server.url, "down") == [(s, float(s)) for s in range(points)]
        server.signal(signal.SIGSTOP)
        try:
            paused = job("paused")
        finally:
            server.signal(signal.SIGCONT)
        # The dead job's start() request waits in the resumed server's backlog: let it land
        # first (a sync racing it would open a second run; noted on #37).
        _wait_for_run(server.url, server.port, "paused")
        sync(paused)  # one run: the one the job's start() asked for, found by its run key
        assert _history(server.url, "paused") == [(s, float(s)) for s in range(points)]
    finally:
        server.kill()
