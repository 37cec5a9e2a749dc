"""Fixtures for the tracker tests: offline settings for every SDK, MLflow stores and server."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from accelkit.trackers import registry
from tests.helpers.mlflow_server import MlflowServer
from tests.helpers.preloaded import JOB_MODULES, Preloaded

ROOT = Path(__file__).resolve().parents[2]

# No test may send a packet off this machine: wandb offline, Comet offline without its
# error-reporting host and cloud metadata probes, MLflow without telemetry, trackio local,
# SwanLab offline (no API key), ClearML offline (no server, its config file ignored).
OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_CONSOLE": "off",
    "COMET_ERROR_TRACKING_ENABLE": "false",
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "COMET_DISABLE_AUTO_LOGGING": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DVC_STUDIO_OFFLINE": "true",
    # trackio imports huggingface_hub: no Hub request, no telemetry
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "GIT_PYTHON_REFRESH": "quiet",
    "CLEARML_OFFLINE_MODE": "1",
    "CLEARML_CONFIG_FILE": os.devnull,
}
_CLOUD_ENV = (
    "WANDB_API_KEY",
    "COMET_API_KEY",
    "MLFLOW_TRACKING_URI",
    "WANDB_DIR",
    "TRACKIO_DIR",
    "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
    "SWANLAB_API_KEY",
    "SWANLAB_MODE",
    "SWANLAB_LOG_DIR",
    "SWANLAB_LOGDIR",
    "CLEARML_API_HOST",
    "CLEARML_API_ACCESS_KEY",
    "CLEARML_API_SECRET_KEY",
    "CLEARML_AUTH_TOKEN",
    "CLEARML_CACHE_DIR",
    "CLEARML_PROJECT",
    "CLEARML_TASK",
)

# The variables are set for the whole session too (session fixtures and the SDKs' own
# background processes read the environment once); the autouse fixture re-asserts them.
os.environ.update(OFFLINE_ENV)
for _name in _CLOUD_ENV:
    os.environ.pop(_name, None)


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a job run as a subprocess: offline, and without the wandb service
    an in-process test of this session started (``WANDB_SERVICE``: a child would attach to it
    instead of starting its own, as a real job does, and a killed child's runs stay open in
    it)."""
    env = {**os.environ, **OFFLINE_ENV, **extra}
    env.pop("WANDB_SERVICE", None)
    return env


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Preloaded]:
    """Fresh job processes (``tests/trackers/resume_job.py``, ``-c`` scripts), each forked from
    one that imported torch, TensorBoard and accelkit once (``tests.helpers.preloaded``): a job
    then costs its run, not 2.5-3.5 s of CPU importing torch. The tracker SDKs (wandb, comet_ml,
    mlflow, swanlab, trackio) start threads and services: each job imports them itself, as a
    real one does. One server per xdist worker, shared by the modules it runs.

    Every job's environment: ``job_env`` on CPU, one OpenMP thread, and ``TMPDIR`` in this
    session's folder (Comet keeps an experiment's messages in a temporary folder until
    ``end()``: a killed job's stays behind, and goes with the session's files)."""
    tmp = tmp_path_factory.mktemp("job-tmp")
    env = job_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ACCELKIT_USE_CPU="1", TMPDIR=str(tmp))
    with Preloaded(list(JOB_MODULES), env=env, cwd=ROOT) as preloaded:
        yield preloaded


def run_job(
    jobs: Preloaded, *argv: str, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *argv`` as a job forked from ``jobs`` (in ``cwd``, else the repository's root),
    its output decoded as ``subprocess.run(..., text=True)`` would."""
    done = jobs.run(*argv, timeout=timeout, cwd=cwd)
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tracker test runs offline (see OFFLINE_ENV)."""
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    for key in _CLOUD_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    """Registrations made by a test do not leak into the next one."""
    saved, removed = dict(registry._registered), set(registry._removed)
    yield
    registry._registered.clear()
    registry._registered.update(saved)
    registry._removed.clear()
    registry._removed.update(removed)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current directory: a backend writing outside the logging dir shows up here."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store with its tables created, to copy (the migrations take ~10 s
    of CPU). Made once a session: under xdist the workers share it, the first one to need it
    builds it under a lock in the session's folder."""
    from filelock import FileLock
    from mlflow import MlflowClient

    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = folder / "mlflow-template.db"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            building = folder / "mlflow-template.building.db"
            building.unlink(missing_ok=True)
            MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments()
            building.replace(path)
    return path


@pytest.fixture
def mlflow_db(mlflow_template_db: Path, tmp_path: Path) -> str:
    """A fresh sqlite tracking URI for one test (a copy of the template store)."""
    path = tmp_path / "mlflow-store" / "mlflow.db"
    path.parent.mkdir()
    shutil.copy(mlflow_template_db, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def mlflow_server(
    mlflow_template_db: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real ``mlflow server`` on 127.0.0.1 (free port, sqlite store); yields its URL."""
    root = tmp_path_factory.mktemp("mlflow-server")
    shutil.copy(mlflow_template_db, root / "mlflow.db")
    env = {**os.environ, **OFFLINE_ENV}
    server = MlflowServer(root, f"sqlite:///{root / 'mlflow.db'}", env=env)
    server.start(timeout=120)
    try:
        yield server.url
    finally:
        server.kill()
