"""Forks against the real backends: a job forks another's checkpoint
(``load_state(path, fork=True)``) and every tracker opens a new run that says where it came
from, read back from each backend's own files: W&B's offline run (its ``branch_point``, what
``fork_from`` records), MLflow's store (``mlflow.parentRunId``), Comet's offline archive,
jsonl's and TensorBoard's files (the ``forked_from`` configuration entry). The parent's runs
are left as they were.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job
from tests.trackers.readers import read_jsonl, read_tensorboard
from tests.trackers.test_continuity_wandb_comet import _read_wandb_file

_TRACKERS = "jsonl,tensorboard,wandb,comet_ml,mlflow"


def _job(jobs: Preloaded, project: Path, uri: str, *args: str) -> None:
    init_kwargs = json.dumps({"mlflow": {"tracking_uri": uri}})
    done: subprocess.CompletedProcess[str] = run_job(
        jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
        "--log-with", _TRACKERS, "--init-kwargs", init_kwargs, *args, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _experiment(project: Path, number: int) -> dict[str, Any]:
    path = project / "checkpoints" / f"checkpoint_{number}" / "accelkit.json"
    return dict(json.loads(path.read_text())["experiment"])


def _comet_parameters(project: Path) -> dict[str, Any]:
    [path] = glob.glob(str(project / "comet_ml" / "*.zip"))
    with zipfile.ZipFile(path) as archive:
        messages = [
            json.loads(line) for line in archive.read("messages.json").decode().splitlines()
        ]
    found = {}
    for message in messages:
        if message["type"] == "parameter_msg":
            param = message["payload"].get("param") or message["payload"].get("params")
            found[param["paramName"]] = param["paramValue"]
    return found


@pytest.mark.slow  # two jobs, each starting five tracker SDKs
def test_every_backend_links_the_forked_run_to_the_checkpoints(
    tmp_path: Path, jobs: Preloaded, mlflow_db: str
) -> None:
    parent, child = tmp_path / "a", tmp_path / "b"
    _job(jobs, parent, mlflow_db, "--steps", "6", "--save-every", "3")
    record = _experiment(parent, 0)
    assert record["step"] == 3
    parent_rows = (parent / "run" / "metrics.jsonl").read_bytes()
    source = str(parent / "checkpoints" / "checkpoint_0")

    _job(
        jobs,
        child,
        mlflow_db,
        "--steps",
        "8",
        "--save-every",
        "3",
        "--fork",
        source,
        "--attempt",
        "1",
    )
    lineage = _experiment(child, 1)["lineage"]
    assert lineage["parent"]["checkpoint"] == source
    assert lineage["parent"]["runs"] == record["runs"]
    forked_from = lineage["parent"]

    # W&B: a new run, branched from the parent's at its last logged step.
    [wandb_file] = glob.glob(str(child / "wandb" / "offline-run-*" / "run-*.wandb"))
    run = _read_wandb_file(wandb_file)
    parent_id = record["runs"]["wandb"]["run_id"]
    assert run["run"]["run_id"] != parent_id
    assert run["run"]["branch_point"] == {"metric": "_step", "run": parent_id, "value": 3}
    assert run["config"]["forked_from"]["checkpoint"] == source
    assert [step for step, _ in run["loss"]][:1] == [4]

    # MLflow: a new run in the same store, whose parent is the checkpoint's run.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_db)
    [experiment] = [e for e in client.search_experiments() if e.name == "run"]
    runs = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}
    parent_run = record["runs"]["mlflow"].get("run_id") or next(
        r.info.run_id for r in runs.values() if r.data.tags.get("accelkit.run_key") == record["key"]
    )
    [forked] = [r for r in runs.values() if r.info.run_id != parent_run]
    assert forked.data.tags["mlflow.parentRunId"] == parent_run
    assert forked.data.tags["accelkit.forked_at_step"] == "3"
    assert forked.data.params["forked_from/checkpoint"] == source
    assert "mlflow.parentRunId" not in runs[parent_run].data.tags
    steps = [m.step for m in client.get_metric_history(forked.info.run_id, "loss")]
    assert steps == [4, 5, 6, 7]

    # Comet: a new experiment whose parameters name the parent.
    params = _comet_parameters(child)
    assert any(k.startswith("forked_from") and v == source for k, v in params.items()), params

    # jsonl and TensorBoard: the configuration entry, and only the child's own steps.
    scalars, _ = read_jsonl(str(child), "run")
    assert [step for step, _ in scalars["loss"]] == [4, 5, 6, 7]
    assert json.loads((child / "run" / "config.json").read_text())["forked_from"] == forked_from
    tb_scalars, tb_config = read_tensorboard(str(child), "run")
    assert tb_config["forked_from/checkpoint"] == source
    assert [step for step, _ in tb_scalars["loss"]] == [4, 5, 6, 7]

    # The parent's files are as it left them.
    assert (parent / "run" / "metrics.jsonl").read_bytes() == parent_rows
    assert os.path.isdir(parent / "checkpoints" / "checkpoint_0")


def test_an_mlflow_fork_survives_a_refused_first_creation(mlflow_db: str) -> None:
    """A server that refuses the first ``create_run`` (down at the start): the retried start
    still links the new run to its parent."""
    from mlflow import MlflowClient

    from accelkit.trackers.backends.mlflow import MLflowTracker

    client = MlflowClient(tracking_uri=mlflow_db)
    experiment = client.create_experiment("forks")
    parent = client.create_run(experiment).info.run_id
    tracker = MLflowTracker("forks", tracking_uri=mlflow_db)
    tracker.name_run("d" * 32)
    reference = {"run_id": parent, "experiment_id": experiment, "tracking_uri": mlflow_db}
    tracker.fork_run(reference, 7)
    refused = []
    real_create = MlflowClient.create_run

    def create_once_refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(kwargs.get("tags"))
            raise ConnectionError("connection refused")
        return real_create(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MlflowClient, "create_run", create_once_refused)
        with pytest.raises(ConnectionError):
            tracker.start()
        tracker.start()  # what the tracker's session does after the backoff
    assert refused[0]["mlflow.parentRunId"] == parent
    run = client.get_run(tracker.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["accelkit.forked_at_step"] == "7"
    assert run.data.tags["accelkit.run_key"] == "d" * 32
    tracker.finish()


def test_a_wandb_fork_survives_a_refused_first_init(tmp_path: Path) -> None:
    import wandb

    from accelkit.trackers.backends.wandb import WandBTracker

    tracker = WandBTracker("forks", logging_dir=str(tmp_path))
    tracker.name_run("e" * 32)
    tracker.fork_run({"run_id": "parentrun1", "project": "forks"}, 9)
    calls: list[dict[str, Any]] = []
    real_init = wandb.init

    def init_once_refused(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 1:
            raise ConnectionError("connection refused")
        return real_init(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wandb, "init", init_once_refused)
        with pytest.raises(ConnectionError):
            tracker.start()  # unreachable: not a refusal of the fork, so not given up
        tracker.start()  # what the tracker's session does after the backoff
    assert [call.get("fork_from") for call in calls] == ["parentrun1?_step=9"] * 2
    assert tracker.run.id == "e" * 32
    tracker.finish()
