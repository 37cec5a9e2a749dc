"""Two real processes (gloo on 127.0.0.1): each main-process-only tracker writes each step once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributed import run_distributed
from tests.trackers import readers
from tests.trackers.conftest import OFFLINE_ENV

BACKENDS = ["tensorboard", "jsonl", "mlflow", "wandb", "comet_ml", "csv_custom"]
STEPS = 4


def _job(logging_dir: str, mlflow_uri: str) -> dict[str, Any]:
    from accelkit import Accelerator, register_tracker
    from tests.trackers.custom import CSVTracker

    register_tracker(CSVTracker)
    accelerator = Accelerator(log_with=BACKENDS, project_dir=logging_dir)
    accelerator.init_trackers(
        "dist",
        config={"world_size": accelerator.num_processes},
        init_kwargs={"mlflow": {"tracking_uri": mlflow_uri}},
    )
    for step in range(STEPS):
        accelerator.log({"loss": 0.5 * step, "rank": accelerator.process_index}, step=step)
    # On every process get_tracker works; elsewhere than the main process it is a stand-in.
    run = accelerator.get_tracker("wandb", unwrap=True)
    if not accelerator.is_main_process:
        run.log({"never": 1})
    workers = sorted(t.name for t in threading.enumerate() if t.name.startswith("accelkit-"))
    info = {
        "rank": accelerator.process_index,
        "trackers": [t.name for t in accelerator.trackers],
        "workers": workers,
        "stand_in": type(accelerator.get_tracker("tensorboard")).__name__,
    }
    accelerator.end_training()
    accelerator.wait_for_everyone()
    return info


@pytest.mark.slow
def test_two_processes_write_each_step_once(tmp_path: Path, mlflow_db: str) -> None:
    logging_dir = tmp_path / "project"
    main, other = run_distributed(
        _job, str(logging_dir), mlflow_db, world_size=2, timeout=240, env=OFFLINE_ENV
    )
    assert main["rank"] == 0 and sorted(main["trackers"]) == sorted(BACKENDS)
    assert len(main["workers"]) == len(BACKENDS)
    assert other["trackers"] == [] and other["workers"] == []
    assert other["stand_in"] == "NullTracker" and main["stand_in"] == "TensorBoardTracker"

    read = {
        "tensorboard": readers.read_tensorboard,
        "jsonl": readers.read_jsonl,
        "wandb": readers.read_wandb,
        "comet_ml": readers.read_comet,
        "csv_custom": readers.read_csv_custom,
        "mlflow": lambda _dir, run: readers.read_mlflow(mlflow_db, run),
    }
    for name in BACKENDS:
        scalars, config = read[name](str(logging_dir), "dist")
        assert scalars["loss"] == [(s, 0.5 * s) for s in range(STEPS)], name
        assert scalars["rank"] == [(s, 0) for s in range(STEPS)], name
        assert int(float(config["world_size"])) == 2, name
