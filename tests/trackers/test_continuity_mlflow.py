"""Experiment continuity with MLflow: a resumed job reopens the checkpoint's run.

MLflow cannot delete metric points, so after a kill at step 150 and a resume from the step-100
checkpoint the one run holds steps 101-150 twice; the resume point is in the run's tags and the
timestamps tell the timelines apart. Stores: sqlite (``mlflow_db``) and a real ``mlflow server``
(``mlflow_server``), read back with ``MlflowClient``.
"""

from __future__ import annotations

import json
import subprocess
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, ProjectConfiguration
from accelkit.trackers.backends.mlflow import (
    LATEST_CHECKPOINT_TAG,
    LOADED_CHECKPOINT_TAG,
    RESUMED_AT_MS_TAG,
    RESUMED_AT_STEP_TAG,
    MLflowTracker,
)
from accelkit.trackers.events import CheckpointEvent
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job


def _job(
    jobs: Preloaded, project: Path, experiment: str, uri: str, *args: str
) -> subprocess.CompletedProcess[str]:
    init_kwargs = json.dumps({"mlflow": {"tracking_uri": uri}})
    return run_job(
        jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
        "--log-with", "mlflow", "--run-name", experiment, "--init-kwargs", init_kwargs, *args,
        timeout=240,
    )  # fmt: skip


def _runs(uri: str, experiment: str) -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else list(client.search_runs([found.experiment_id]))


def _history(uri: str, run_id: str, key: str) -> list[Any]:
    from mlflow import MlflowClient

    points = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return sorted(points, key=lambda m: (m.step, m.timestamp))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("store", "order"), [("mlflow_db", "init-first"), ("mlflow_server", "load-first")]
)
def test_a_killed_job_resumes_the_same_run(
    store: str, order: str, tmp_path: Path, request: pytest.FixtureRequest, jobs: Preloaded
) -> None:
    uri: str = request.getfixturevalue(store)
    experiment = f"continuity-{tmp_path.name}"  # the server lives for the whole session
    project = tmp_path / "project"
    killed = _job(jobs, project, experiment, uri, "--kill-at", "150")
    assert killed.returncode == -9, killed.stderr[-3000:]
    (first,) = _runs(uri, experiment)
    run_id = first.info.run_id

    # The manifest names the run: by its id once open, by its run key (the run's tag) while
    # it was still opening when the checkpoint was saved.
    checkpoint = project / "checkpoints" / "checkpoint_0"
    record = json.loads((checkpoint / "accelkit.json").read_text())["experiment"]
    assert record["step"] == 100
    key = record["key"]
    named = {"run_key": key, "experiment_name": experiment, "tracking_uri": uri}
    opened = {**named, "run_id": run_id, "experiment_id": first.info.experiment_id}
    assert record["runs"]["mlflow"] in (named, opened)
    assert first.data.tags["accelkit.run_key"] == key

    resumed = _job(jobs, project, experiment, uri, "--resume", "--attempt", "1", "--order", order)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not continued" not in resumed.stderr and "Tracker" not in resumed.stderr

    (run,) = _runs(uri, experiment)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags[RESUMED_AT_STEP_TAG] == "100"
    assert dict(run.data.params) == {"lr": "0.1"}  # the config logged again, unchanged

    # One run reaching step 199; 101-150 hold the killed attempt's point and the resumed one,
    # told apart by the resume time.
    loss = _history(uri, run_id, "loss")
    assert max(m.step for m in loss) == 199
    resumed_at = int(tags[RESUMED_AT_MS_TAG])
    before = [(m.step, m.value) for m in loss if m.timestamp < resumed_at]
    after = [(m.step, m.value) for m in loss if m.timestamp >= resumed_at]
    assert before == [(s, float(s)) for s in range(151)]
    assert after == [(s, float(s + 1000)) for s in range(101, 200)]

    # The checkpoint events: numbers at the save's step, the path in tags.
    saved = _history(uri, run_id, "checkpoint/bytes")
    assert [m.step for m in saved] == [100] and saved[0].value > 0
    assert [m.step for m in _history(uri, run_id, "checkpoint/save_seconds")] == [100]
    assert [(m.step, m.value) for m in _history(uri, run_id, "checkpoint/resumed_step")] == [
        (100, 100.0)
    ]
    assert tags[LATEST_CHECKPOINT_TAG] == str(checkpoint)
    assert tags["accelkit.checkpoint.0"] == str(checkpoint)
    assert tags[LOADED_CHECKPOINT_TAG] == str(checkpoint)


def _save_one_run(project: Path, uri: str, experiment: str) -> tuple[str, Path]:
    """An in-process job: log steps 0-4, save checkpoint_0, end; returns its run id."""
    accelerator = Accelerator(
        log_with="mlflow",
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True
        ),
    )
    accelerator.init_trackers(experiment, init_kwargs={"mlflow": {"tracking_uri": uri}})
    for step in range(5):
        accelerator.log({"loss": float(step)}, step=step)
    accelerator.get_tracker("mlflow")  # the run is open: the checkpoint records its id
    accelerator.save_state()
    accelerator.end_training()
    checkpoint = project / "checkpoints" / "checkpoint_0"
    record = json.loads((checkpoint / "accelkit.json").read_text())
    return record["experiment"]["runs"]["mlflow"]["run_id"], checkpoint


def _resume_in_process(project: Path, uri: str, experiment: str, *, continue_runs: bool) -> None:
    accelerator = Accelerator(
        log_with="mlflow",
        project_config=ProjectConfiguration(
            project_dir=str(project),
            automatic_checkpoint_naming=True,
            continue_tracker_runs=continue_runs,
        ),
    )
    accelerator.load_state()
    accelerator.init_trackers(experiment, init_kwargs={"mlflow": {"tracking_uri": uri}})
    accelerator.log({"loss": 50.0})
    accelerator.end_training()


def _edit_reference(checkpoint: Path, **changes: Any) -> None:
    path = checkpoint / "accelkit.json"
    manifest = json.loads(path.read_text())
    manifest["experiment"]["runs"]["mlflow"].update(changes)
    path.write_text(json.dumps(manifest))


def test_a_reference_to_another_store_redirects_nothing(
    mlflow_db: str, mlflow_template_db: Path, tmp_path: Path
) -> None:
    """A checkpoint naming another tracking URI (which holds the same run id) is not
    followed: the job logs to a new run where it is configured to log."""
    import shutil

    experiment = "crafted"
    project = tmp_path / "project"
    run_id, checkpoint = _save_one_run(project, mlflow_db, experiment)
    elsewhere = tmp_path / "elsewhere.db"
    shutil.copy(mlflow_db.removeprefix("sqlite:///"), elsewhere)
    _edit_reference(checkpoint, tracking_uri=f"sqlite:///{elsewhere}")

    with pytest.warns(UserWarning, match=rf"run '{run_id}' is not continued: it was logged to"):
        _resume_in_process(project, mlflow_db, experiment, continue_runs=True)
    runs = {run.info.run_id: run for run in _runs(mlflow_db, experiment)}
    assert len(runs) == 2 and run_id in runs
    new_id = next(key for key in runs if key != run_id)
    assert RESUMED_AT_STEP_TAG not in runs[run_id].data.tags
    assert [m.step for m in _history(mlflow_db, run_id, "loss")] == [0, 1, 2, 3, 4]
    # The resumed job continues the step count in its new run.
    assert [(m.step, m.value) for m in _history(mlflow_db, new_id, "loss")] == [(5, 50.0)]
    (copy,) = _runs(f"sqlite:///{elsewhere}", experiment)
    assert copy.info.run_id == run_id and RESUMED_AT_STEP_TAG not in copy.data.tags
    assert len(_history(f"sqlite:///{elsewhere}", run_id, "loss")) == 5


def test_no_continue_starts_a_new_run(mlflow_db: str, tmp_path: Path) -> None:
    project = tmp_path / "project"
    run_id, _ = _save_one_run(project, mlflow_db, "no-continue")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: continuing is off
        _resume_in_process(project, mlflow_db, "no-continue", continue_runs=False)
    runs = _runs(mlflow_db, "no-continue")
    assert len(runs) == 2
    assert all(RESUMED_AT_STEP_TAG not in run.data.tags for run in runs)
    assert len(_history(mlflow_db, run_id, "loss")) == 5


def _resume_with_an_instance(
    project: Path, uri: str, experiment: str, *, before_load: Any = None
) -> MLflowTracker:
    """A job given an MLflowTracker instance, calling init_trackers before load_state (the
    order of Accelerate's examples); ``before_load(tracker)`` uses the instance in between."""
    tracker = MLflowTracker(experiment, tracking_uri=uri)
    accelerator = Accelerator(
        log_with=tracker,
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True
        ),
    )
    accelerator.init_trackers(experiment, config={"lr": 0.1})
    # Started by init_trackers, as Accelerate starts it: its owner may use it at once.
    assert tracker.active_run is not None
    if before_load is not None:
        before_load(tracker)
    accelerator.load_state()
    accelerator.log({"loss": 50.0})
    accelerator.end_training()
    return tracker


def test_an_instance_started_by_init_trackers_continues_the_checkpoints_run_after_a_load(
    mlflow_db: str, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    project = tmp_path / "project"
    run_id, _ = _save_one_run(project, mlflow_db, "instance")
    opened: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left behind: no warning
        tracker = _resume_with_an_instance(
            project,
            mlflow_db,
            "instance",
            before_load=lambda t: opened.append(t.active_run.info.run_id),
        )
    # The run init_trackers opened held only its params: given up for the checkpoint's run
    # and deleted, so the experiment shows the one run, continued.
    assert opened and opened[0] != run_id
    client = MlflowClient(tracking_uri=mlflow_db)
    assert client.get_run(opened[0]).info.lifecycle_stage == "deleted"
    (run,) = _runs(mlflow_db, "instance")
    assert run.info.run_id == run_id == tracker.active_run.info.run_id
    assert run.data.tags[RESUMED_AT_STEP_TAG] == "4"
    assert [(m.step, m.value) for m in _history(mlflow_db, run_id, "loss")][-1] == (5, 50.0)


def test_a_run_the_owner_logged_to_before_the_load_is_kept_with_a_warning(
    mlflow_db: str, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    run_id, _ = _save_one_run(project, mlflow_db, "kept")
    with pytest.warns(UserWarning, match=r"was finished and is left as it is"):
        _resume_with_an_instance(
            project, mlflow_db, "kept", before_load=lambda t: t.log({"direct": 1.0}, step=0)
        )
    runs = {run.info.run_id: run for run in _runs(mlflow_db, "kept")}
    assert len(runs) == 2 and run_id in runs  # the owner's values are never deleted
    other = next(key for key in runs if key != run_id)
    assert [m.value for m in _history(mlflow_db, other, "direct")] == [1.0]
    assert [(m.step, m.value) for m in _history(mlflow_db, run_id, "loss")][-1] == (5, 50.0)


def _tracker(uri: str, experiment: str = "direct") -> MLflowTracker:
    return MLflowTracker(experiment, tracking_uri=uri)


def _started(uri: str, experiment: str = "direct") -> MLflowTracker:
    tracker = _tracker(uri, experiment)
    tracker.start()
    return tracker


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"run_id": "../../etc/passwd"}, "is not an MLflow run id"),
        ({"run_id": "a" * 500}, "is not an MLflow run id"),
        ({"run_id": 12345}, "is not an MLflow run id"),
        ({"experiment_id": "1; DROP TABLE runs"}, "is not an MLflow experiment id"),
        ({"tracking_uri": None}, "is not a tracking URI"),
        ({"run_id": uuid.uuid4().hex}, "has no such run"),
        ({"experiment_id": "999"}, "belongs to experiment id"),
    ],
)
def test_a_crafted_or_vanished_reference_is_a_warning_and_a_new_run(
    mlflow_db: str, change: dict[str, Any], message: str
) -> None:
    original = _started(mlflow_db)
    reference = original.run_reference()
    assert reference is not None
    original.finish()
    tracker = _tracker(mlflow_db)
    with pytest.warns(UserWarning, match=message):
        tracker.continue_run({**reference, **change}, 10)
        tracker.start()
    assert tracker.run_id != reference["run_id"]
    tracker.log({"loss": 1.0}, step=11)
    tracker.finish()
    assert len(_runs(mlflow_db, "direct")) == 2


def test_a_deleted_run_or_another_experiment_is_not_reopened(mlflow_db: str) -> None:
    from mlflow import MlflowClient

    deleted = _started(mlflow_db)
    reference = deleted.run_reference()
    assert reference is not None
    MlflowClient(tracking_uri=mlflow_db).delete_run(deleted.run_id)
    tracker = _tracker(mlflow_db)
    with pytest.warns(UserWarning, match="the run is deleted"):
        tracker.continue_run(reference, 3)
        tracker.start()
    assert tracker.run_id != reference["run_id"]

    # A run of experiment "direct" named by a job logging to experiment "other".
    live = _started(mlflow_db)
    reference = live.run_reference()
    assert reference is not None
    other = _tracker(mlflow_db, "other")
    with pytest.warns(UserWarning, match="this tracker logs to experiment 'other'"):
        other.continue_run(reference, 3)
        other.start()
    assert other.run_id != reference["run_id"]
    assert RESUMED_AT_STEP_TAG not in MlflowClient(mlflow_db).get_run(live.run_id).data.tags


def test_resuming_twice_appends_the_resume_point_and_keeps_the_params(mlflow_db: str) -> None:
    from mlflow import MlflowClient

    first = _started(mlflow_db)
    first.store_init_configuration({"lr": 0.1, "model": {"depth": 2}})
    reference = first.run_reference()
    assert reference is not None
    first.finish()

    second = _tracker(mlflow_db)
    second.continue_run(reference, 10)
    second.start()
    assert second.run_id == reference["run_id"]
    assert MlflowClient(mlflow_db).get_run(second.run_id).info.status == "RUNNING"
    with pytest.warns(UserWarning, match=r"already has params 'lr' with other values") as caught:
        second.store_init_configuration({"lr": 0.5, "model": {"depth": 2}, "seed": 3})
    assert len(caught) == 1
    second.finish()

    third = _tracker(mlflow_db)
    third.continue_run(second.run_reference(), 20)
    third.start()
    third.finish()
    run = MlflowClient(mlflow_db).get_run(reference["run_id"])
    assert run.data.params == {"lr": "0.1", "model/depth": "2", "seed": "3"}
    assert run.data.tags[RESUMED_AT_STEP_TAG] == "10,20"
    stamps = [int(ms) for ms in run.data.tags[RESUMED_AT_MS_TAG].split(",")]
    assert len(stamps) == 2 and stamps[0] <= stamps[1]
    assert run.info.status == "FINISHED"


def test_checkpoint_events_are_metrics_at_their_step_and_path_tags(mlflow_db: str) -> None:
    from mlflow import MlflowClient

    tracker = _started(mlflow_db)
    tracker.on_checkpoint(
        CheckpointEvent("save", 40, "/runs/p/checkpoints/checkpoint_3", 3, {"checkpoint/bytes": 9})
    )
    tracker.on_checkpoint(CheckpointEvent("save", 7, "/runs/p/best model!", None, {}))
    tracker.on_checkpoint(
        CheckpointEvent("load", 40, "/runs/p/checkpoints/checkpoint_3", 3, {"checkpoint/x": 1})
    )
    tracker.finish()
    run = MlflowClient(mlflow_db).get_run(tracker.run_id)
    tags = run.data.tags
    assert tags["accelkit.checkpoint.3"] == "/runs/p/checkpoints/checkpoint_3"
    assert tags["accelkit.checkpoint.best model_"] == "/runs/p/best model!"
    assert tags[LATEST_CHECKPOINT_TAG] == "/runs/p/best model!"  # the last save
    assert tags[LOADED_CHECKPOINT_TAG] == "/runs/p/checkpoints/checkpoint_3"
    saved = _history(mlflow_db, run.info.run_id, "checkpoint/bytes")
    assert [(m.step, m.value) for m in saved] == [(40, 9.0)]


@pytest.mark.slow
def test_the_reference_holds_no_credentials_and_still_matches(mlflow_server: str) -> None:
    """A tracking URI with a user and password is recorded without them; the same URI
    (credentials included) continues the run."""
    with_password = mlflow_server.replace("http://", "http://someone:s3cret@")
    tracker = _started(with_password, "credentials")
    reference = tracker.run_reference()
    assert reference is not None and reference["tracking_uri"] == mlflow_server
    assert "s3cret" not in json.dumps(reference)
    tracker.finish()
    again = _tracker(with_password, "credentials")
    again.continue_run(reference, 4)
    again.start()
    assert again.run_id == reference["run_id"]
    again.finish()


def test_an_explicit_run_id_takes_priority_over_the_checkpoint(mlflow_db: str) -> None:
    from mlflow import MlflowClient

    chosen, other = _started(mlflow_db), _started(mlflow_db)
    reference = other.run_reference()
    assert reference is not None
    tracker = MLflowTracker("direct", run_id=chosen.run_id, tracking_uri=mlflow_db)
    with pytest.warns(UserWarning, match="was given and takes priority"):
        tracker.continue_run(reference, 8)
        tracker.start()
    assert tracker.run_id == chosen.run_id
    # The same run named both ways is a continuation: the resume point is recorded.
    same = MLflowTracker("direct", run_id=other.run_id, tracking_uri=mlflow_db)
    same.continue_run(reference, 8)
    same.start()
    client = MlflowClient(mlflow_db)
    assert client.get_run(other.run_id).data.tags[RESUMED_AT_STEP_TAG] == "8"
    assert RESUMED_AT_STEP_TAG not in client.get_run(chosen.run_id).data.tags


def test_a_run_named_by_its_key_is_found_created_or_refused(mlflow_db: str) -> None:
    """A checkpoint saved before the MLflow run opened names it by its run key (``name_run``).
    A resumed tracker finds the run tagged with the key (no second run), creates it with the
    tag when the killed job never reached the store, and follows no key into another
    experiment or store. A malformed key is refused like a malformed run id."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_db)
    key = uuid.uuid4().hex
    first = _tracker(mlflow_db, "keyed")
    named = first.name_run(key)
    assert named == {"run_key": key, "experiment_name": "keyed", "tracking_uri": mlflow_db}
    first.start()  # the run the key names, tagged with it
    assert first.run_reference() == {
        **named, "run_id": first.run_id, "experiment_id": first.run.info.experiment_id}  # fmt: skip
    first.finish()

    found = _tracker(mlflow_db, "keyed")
    found.name_run(key)
    found.continue_run(named, 7)
    found.start()
    assert found.run_id == first.run_id
    assert client.get_run(first.run_id).data.tags[RESUMED_AT_STEP_TAG] == "7"

    never = uuid.uuid4().hex  # named, then killed before create_run reached the store
    created = _tracker(mlflow_db, "keyed")
    created.name_run(never)
    created.continue_run({**named, "run_key": never}, 3)
    created.start()
    run = client.get_run(str(created.run_id))
    assert run.data.tags["accelkit.run_key"] == never and run.data.tags[RESUMED_AT_STEP_TAG] == "3"
    experiment = client.get_experiment_by_name("keyed")
    assert experiment is not None and len(client.search_runs([experiment.experiment_id])) == 2

    for change, message in [
        ({"experiment_name": "other"}, "belongs to experiment 'other'"),
        ({"tracking_uri": "sqlite:////elsewhere.db"}, "it was logged to"),
        ({"run_key": "x' OR '1'='1"}, "is not a run key"),
    ]:
        elsewhere = _tracker(mlflow_db, "keyed")
        elsewhere.name_run(key)
        with pytest.warns(UserWarning, match=message):
            elsewhere.continue_run({**named, **change}, 9)
            elsewhere.start()
        assert elsewhere.run_id != first.run_id
        assert "accelkit.run_key" not in elsewhere.run.data.tags  # not the checkpoint's run
