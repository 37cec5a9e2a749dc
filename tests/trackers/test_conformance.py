"""One contract, run against every built-in backend and a custom `GeneralTracker` subclass.

Each backend writes for real (TensorBoard event files, a sqlite MLflow store, an offline wandb
run, an offline Comet archive, JSON lines, a custom CSV) and is read back with its own reader.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accelkit import Accelerator
from accelkit.trackers import TrackerWarning, register_tracker
from tests.trackers import readers
from tests.trackers.custom import CSVTracker

RUN = "conformance"
STEPS = 5
CONFIG: dict[str, Any] = {
    "lr": 0.001,
    "layers": [64, 32],
    "optimizer": {"name": "adam", "betas": torch.tensor([0.5, 0.25])},
    "scheduler": None,
    "output": Path("/tmp/out"),
    "epochs": torch.tensor(3),
}


@dataclass(frozen=True)
class Backend:
    read: Callable[[str, str], tuple[readers.Scalars, dict[str, Any]]]
    files: str  # a glob, relative to the logging dir, that the backend must have written
    unwrapped: str  # the class name of ``get_tracker(name, unwrap=True)``


def _read_mlflow(logging_dir: str, run: str) -> tuple[readers.Scalars, dict[str, Any]]:
    return readers.read_mlflow(f"sqlite:///{logging_dir}/mlflow.db", run)


BACKENDS = {
    "tensorboard": Backend(
        readers.read_tensorboard, f"{RUN}/events.out.tfevents.*", "SummaryWriter"
    ),
    "jsonl": Backend(readers.read_jsonl, f"{RUN}/metrics.jsonl", "TextIOWrapper"),
    "mlflow": Backend(_read_mlflow, "mlflow.db", "Run"),
    "wandb": Backend(readers.read_wandb, "wandb/offline-run-*/run-*.wandb", "Run"),
    "comet_ml": Backend(readers.read_comet, "comet_ml/*.zip", "OfflineExperiment"),
    "csv_custom": Backend(readers.read_csv_custom, f"{RUN}/custom.csv", "TextIOWrapper"),
}


def _values(step: int) -> dict[str, Any]:
    return {
        "loss": torch.tensor(1.0 / (step + 1)),
        "lr": 0.1 * step,
        "count": np.int64(step),
        "note": "free text",
        "blob": object(),
    }


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_contract(
    name: str, tmp_path: Path, workdir: Path, mlflow_template_db: Path
) -> None:
    backend = BACKENDS[name]
    logging_dir = tmp_path / "project"
    if name == "csv_custom":
        register_tracker(CSVTracker)
    if name == "mlflow":
        # The default store is sqlite under the logging dir; start from a migrated copy.
        logging_dir.mkdir()
        shutil.copy(mlflow_template_db, logging_dir / "mlflow.db")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(log_with=name, project_dir=str(logging_dir))
        accelerator.init_trackers(RUN, config=CONFIG)
        for step in range(STEPS):
            accelerator.log(_values(step), step=step)
        tracker = accelerator.get_tracker(name)
        assert tracker.name == name
        assert type(accelerator.get_tracker(name, unwrap=True)).__name__ == backend.unwrapped
        accelerator.end_training()

    failures = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert failures == [], failures
    about_blob = [w for w in caught if "'blob'" in str(w.message)]
    assert len(about_blob) <= 1, [str(w.message) for w in about_blob]

    # Everything the backend wrote is under the logging dir; nothing in the working directory.
    assert list(logging_dir.glob(backend.files)), f"{name} wrote no {backend.files}"
    assert sorted(p.name for p in workdir.iterdir()) == []

    scalars, config = backend.read(str(logging_dir), RUN)
    expected = {
        "loss": [(s, 1.0 / (s + 1)) for s in range(STEPS)],
        "lr": [(s, 0.1 * s) for s in range(STEPS)],
        "count": [(s, float(s)) for s in range(STEPS)],
    }
    for key, points in expected.items():
        assert [step for step, _ in scalars[key]] == list(range(STEPS)), (key, scalars[key])
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in points], rel=1e-6)

    config = {key.replace("|", "/"): value for key, value in config.items()}
    assert float(config["lr"]) == pytest.approx(0.001)
    assert config["optimizer/name"] == "adam"
    assert str(config["output"]) == "/tmp/out"
    assert int(float(config["epochs"])) == 3
    assert "scheduler" in config
    assert "64" in str(config["layers"]) and "32" in str(config["layers"])
    assert "0.25" in str(config["optimizer/betas"])
