"""Every built-in backend and two custom `GeneralTracker` subclasses (the tests' and the one
in ``examples/custom_tracker.py``) pass the shipped contract
(:class:`accelkit.testing.TrackerContract`).

Each backend writes for real (TensorBoard event files, a sqlite MLflow store, an offline wandb
run, an offline Comet archive, a trackio database, an offline SwanLab run, an offline ClearML
session, a DVCLive folder, an Aim repository, JSON lines, custom CSVs) and is read back with its
own reader.
"""

from __future__ import annotations

import csv
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from accelkit.testing import TrackerContract
from accelkit.trackers import register_tracker
from tests.trackers import readers
from tests.trackers.custom import CSVTracker


class TestTensorBoard(TrackerContract):
    log_with, files, unwrapped = "tensorboard", "conformance/events.out.tfevents.*", "SummaryWriter"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_tensorboard(logging_dir, run)


class TestJSONL(TrackerContract):
    log_with, files, unwrapped = "jsonl", "conformance/metrics.jsonl", "TextIOWrapper"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_jsonl(logging_dir, run)


@pytest.mark.slow
class TestMLflow(TrackerContract):
    log_with, files, unwrapped = "mlflow", "mlflow.db", "Run"

    @pytest.fixture
    def logging_dir(self, tmp_path: Path, mlflow_template_db: Path) -> Path:
        # The default store is sqlite under the logging dir; start from a migrated copy.
        project = tmp_path / "project"
        project.mkdir()
        shutil.copy(mlflow_template_db, project / "mlflow.db")
        return project

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_mlflow(f"sqlite:///{logging_dir}/mlflow.db", run)


@pytest.mark.slow
class TestWandbOffline(TrackerContract):
    log_with, files, unwrapped = "wandb", "wandb/offline-run-*/run-*.wandb", "Run"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_wandb(logging_dir, run)


@pytest.mark.slow
class TestCometOffline(TrackerContract):
    log_with, files, unwrapped = "comet_ml", "comet_ml/*.zip", "OfflineExperiment"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_comet(logging_dir, run)


@pytest.mark.slow
class TestTrackio(TrackerContract):
    log_with, files, unwrapped = "trackio", "trackio/conformance.db", "Run"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_trackio(logging_dir, run)


@pytest.mark.slow
class TestSwanLabOffline(TrackerContract):
    log_with, files, unwrapped = "swanlab", "swanlog/run-*/run-*.swanlab", "Run"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_swanlab(logging_dir, run)


class TestClearMLOffline(TrackerContract):
    log_with, files, unwrapped = "clearml", "clearml/offline/offline-*/metrics.jsonl", "Task"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_clearml(logging_dir, run)


class TestDVCLive(TrackerContract):
    log_with, files, unwrapped = "dvclive", "conformance/dvclive/plots/metrics/loss.tsv", "Live"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_dvclive(logging_dir, run)


class TestAim(TrackerContract):
    log_with, files, unwrapped = "aim", ".aim/meta/chunks/*", "Run"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_aim(logging_dir, run)


class TestCustomTracker(TrackerContract):
    log_with, files, unwrapped = "csv_custom", "conformance/custom.csv", "TextIOWrapper"
    register = CSVTracker

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_csv_custom(logging_dir, run)


def _example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"accelkit_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestExampleCustomTracker(TrackerContract):
    log_with, files, unwrapped = "csv", "conformance/metrics.csv", "TextIOWrapper"
    flattens_config = False  # it logs each top-level config key as a row

    @pytest.fixture
    def registered(self) -> Iterator[None]:
        # Loading the example registers its tracker; the autouse clean_registry undoes it.
        register_tracker(_example("custom_tracker").CSVTracker)
        yield

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        scalars: readers.Scalars = {}
        config: dict[str, Any] = {}
        with open(Path(logging_dir, run, "metrics.csv"), encoding="utf-8") as file:
            for row in csv.DictReader(file):
                if row["name"].startswith("config/"):
                    config[row["name"].removeprefix("config/")] = row["value"]
                    continue
                try:
                    value = float(row["value"])
                except ValueError:
                    continue  # text and objects the example writes as they are
                scalars.setdefault(row["name"], []).append((int(row["step"]), value))
        return scalars, config
