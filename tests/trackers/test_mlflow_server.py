"""MLflow against a real ``mlflow server`` process on 127.0.0.1 (one per test session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accelkit import Accelerator
from tests.trackers import readers


@pytest.mark.slow
def test_logs_reach_a_real_mlflow_server(mlflow_server: str, tmp_path: Path, workdir: Path) -> None:
    accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path / "project"))
    accelerator.init_trackers(
        "server-run",
        config={"lr": 0.01, "model": {"depth": 4, "widths": [8, 16]}, "seed": None},
        init_kwargs={
            "mlflow": {"tracking_uri": mlflow_server, "run_name": "first", "tags": {"k": "v"}}
        },
    )
    for step in range(10):
        accelerator.log({"loss": torch.tensor(10.0 - step), "eval": {"acc": step / 10}}, step=step)
    run = accelerator.get_tracker("mlflow", unwrap=True)
    accelerator.end_training()

    scalars, params = readers.read_mlflow(mlflow_server, "server-run")
    assert scalars["loss"] == [(s, 10.0 - s) for s in range(10)]
    assert scalars["eval/acc"] == [(s, s / 10) for s in range(10)]
    assert params == {"lr": "0.01", "model/depth": "4", "model/widths": "[8, 16]", "seed": "None"}
    assert run.info.run_name == "first" and run.data.tags["k"] == "v"
    # With a server URI nothing is written locally.
    assert list(workdir.iterdir()) == []
    assert not (tmp_path / "project" / "mlflow.db").exists()
