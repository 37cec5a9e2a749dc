"""Backend methods beyond ``log`` (Accelerate's signatures), written for real and read back:
``MLflowTracker.log_artifact/log_artifacts/log_figure`` against a sqlite store, and
``WandBTracker.log_table`` in an offline run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelkit import Accelerator
from accelkit.tracking import MLflowTracker
from tests.trackers import readers


@pytest.mark.slow
def test_mlflow_artifacts_and_figures_are_stored_in_the_run(tmp_path: Path, mlflow_db: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

    notes = tmp_path / "notes.txt"
    notes.write_text("first artifact\n")
    folder = tmp_path / "folder"
    (folder / "deep").mkdir(parents=True)
    (folder / "a.json").write_text('{"a": 1}')
    (folder / "deep" / "b.txt").write_text("b")
    figure = Figure()
    figure.add_subplot().plot([0, 1, 2], [2, 1, 0])

    accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path / "project"))
    accelerator.init_trackers(
        "artifacts",
        init_kwargs={
            "mlflow": {
                "tracking_uri": mlflow_db,
                "artifact_location": (tmp_path / "store").as_uri(),
            }
        },
    )
    tracker = accelerator.get_tracker("mlflow")
    assert isinstance(tracker, MLflowTracker)
    tracker.log_artifact(str(notes))
    tracker.log_artifact(str(notes), artifact_path="texts")
    tracker.log_artifacts(str(folder), artifact_path="folder")
    tracker.log_figure(figure, "plots/line.png", dpi=50)
    run_id = tracker.run_id
    accelerator.end_training()

    client = MlflowClient(tracking_uri=mlflow_db)

    def listing(path: str | None = None) -> list[str]:
        return sorted(info.path for info in client.list_artifacts(run_id, path))

    assert listing() == ["folder", "notes.txt", "plots", "texts"]
    assert listing("folder") == ["folder/a.json", "folder/deep"]
    assert listing("folder/deep") == ["folder/deep/b.txt"]
    download = Path(client.download_artifacts(run_id, "", str(tmp_path / "download")))
    assert (download / "notes.txt").read_text() == "first artifact\n"
    assert (download / "texts" / "notes.txt").read_text() == "first artifact\n"
    assert json.loads((download / "folder" / "a.json").read_text()) == {"a": 1}
    assert (download / "folder" / "deep" / "b.txt").read_text() == "b"
    png = (download / "plots" / "line.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 500


def test_mlflow_artifact_methods_need_a_started_run() -> None:
    with pytest.raises(RuntimeError, match=r"log_artifact\(\) needs a started run.*init_trackers"):
        MLflowTracker("never-started").log_artifact("x")


@pytest.mark.slow
def test_wandb_log_table_is_written_and_read_back(tmp_path: Path) -> None:
    project = tmp_path / "project"
    accelerator = Accelerator(log_with="wandb", project_dir=str(project))
    accelerator.init_trackers("tables")
    accelerator.log({"loss": 1.0}, step=0)
    tracker = accelerator.get_tracker("wandb")
    tracker.log_table("samples", columns=["text", "score"], data=[["a", 1], ["b", 2.5]], step=1)
    import pandas as pd

    frame = pd.DataFrame({"x": [1, 2, 3], "y": ["p", "q", "r"]})
    tracker.log_table("frame", dataframe=frame, step=2)
    accelerator.end_training()

    run_file = readers.wandb_run_file(str(project))
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "wandb"), "leet", "inspect", "--json",
         run_file],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    tables: dict[str, tuple[int, dict[str, object]]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{") and json.loads(line).get("type") == "history":
            item = json.loads(line)["history"]["item"]
            for key in ("samples", "frame"):
                if item.get(f"{key}._type") == "table-file":
                    path = Path(run_file).parent / "files" / item[f"{key}.path"]
                    tables[key] = (item["_step"], json.loads(path.read_text()))
    assert tables["samples"] == (1, {"columns": ["text", "score"], "data": [["a", 1], ["b", 2.5]]})
    step, frame_table = tables["frame"]
    assert step == 2 and frame_table["columns"] == ["x", "y"]
    assert frame_table["data"] == [[1, "p"], [2, "q"], [3, "r"]]


def test_mlflow_environment_overrides_and_nested_runs(
    mlflow_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "vision"}')
    parent_experiment = MlflowClient(mlflow_db).create_experiment("parents")
    with mlflow.start_run(experiment_id=parent_experiment) as parent:
        tracker = MLflowTracker("from-argument", None, None, None, True, "child")
        tracker.start()
        tracker.finish()
    run = MlflowClient(mlflow_db).get_run(tracker.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert run.data.tags["team"] == "vision" and run.info.run_name == "child"
    experiment = MlflowClient(mlflow_db).get_experiment(run.info.experiment_id)
    assert experiment.name == "from-env"


def test_mlflow_active_run_and_log_metrics_keywords_as_in_accelerate(
    tmp_path: Path, mlflow_db: str
) -> None:
    """``tracker.active_run.info.run_id`` (Accelerate's attribute) and ``log``'s keywords,
    which Accelerate passes to ``mlflow.log_metrics``: ``timestamp``, ``model_id``, ``dataset``
    reach the stored metric."""
    import mlflow.data
    import numpy as np
    from mlflow import MlflowClient

    assert MLflowTracker("never-started").active_run is None
    accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path / "project"))
    store = (tmp_path / "store").as_uri()
    accelerator.init_trackers(
        "keywords",
        init_kwargs={"mlflow": {"tracking_uri": mlflow_db, "artifact_location": store}},
    )
    tracker = accelerator.get_tracker("mlflow")
    assert isinstance(tracker, MLflowTracker)
    run_id = tracker.active_run.info.run_id
    assert run_id == tracker.run_id
    client = MlflowClient(tracking_uri=mlflow_db)
    model = client.create_logged_model(tracker.active_run.info.experiment_id)
    dataset = mlflow.data.from_numpy(np.arange(6.0), name="train-set")
    tracker.log(
        {"loss": 0.5}, step=3, timestamp=1_700_000_000_000, model_id=model.model_id, dataset=dataset
    )
    accelerator.end_training()
    (metric,) = client.get_metric_history(run_id, "loss")
    assert (metric.value, metric.step, metric.timestamp) == (0.5, 3, 1_700_000_000_000)
    (linked,) = client.get_logged_model(model.model_id).metrics
    assert (linked.key, linked.value, linked.run_id) == ("loss", 0.5, run_id)
    assert (linked.dataset_name, linked.dataset_digest) == ("train-set", dataset.digest)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "variable", "inside"),
    [("wandb", "WANDB_DIR", "wandb"), ("comet_ml", "COMET_OFFLINE_DIRECTORY", "")],
)
def test_the_backends_own_directory_variable_wins_over_the_logging_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, variable: str, inside: str
) -> None:
    """accelkit puts a backend's files under the project's logging directory unless the user
    said where with the backend's documented variable (as Accelerate leaves it to the backend)."""
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    monkeypatch.setenv(variable, str(chosen))
    project = tmp_path / "project"
    accelerator = Accelerator(log_with=name, project_dir=str(project))
    accelerator.init_trackers("directory-variable")
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.end_training()
    written = [p for p in (chosen / inside).rglob("*") if p.is_file()]
    assert written, f"{name} wrote nothing under {variable}={chosen}"
    assert not (project / name).exists(), sorted(str(p) for p in project.rglob("*"))
