"""Every built-in backend and a custom `GeneralTracker` subclass pass the shipped contract
(:class:`accelkit.testing.TrackerContract`).

Each backend writes for real (TensorBoard event files, a sqlite MLflow store, an offline wandb
run, an offline Comet archive, JSON lines, a custom CSV) and is read back with its own reader.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from accelkit.testing import TrackerContract
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


class TestWandbOffline(TrackerContract):
    log_with, files, unwrapped = "wandb", "wandb/offline-run-*/run-*.wandb", "Run"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_wandb(logging_dir, run)


class TestCometOffline(TrackerContract):
    log_with, files, unwrapped = "comet_ml", "comet_ml/*.zip", "OfflineExperiment"

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_comet(logging_dir, run)


class TestCustomTracker(TrackerContract):
    log_with, files, unwrapped = "csv_custom", "conformance/custom.csv", "TextIOWrapper"
    register = CSVTracker

    def read_back(self, logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
        return readers.read_csv_custom(logging_dir, run)
