"""Experiment continuity with W&B and Comet, offline, read back from the files they wrote.

A job (``tests/trackers/resume_job.py``) logging to both is killed with SIGKILL after its
step-100 checkpoint at step 150 and resumed in a new process. Neither backend can forget the
points logged after the checkpoint, so the checks are: one W&B run id across both offline
folders and one Comet experiment key across both archives, the resumed steps logged once with
the resumed values, the resume point recorded, the checkpoint events at the save's step with
the checkpoint's path, and checkpoint references that do not belong here ignored (a warning
and a new run). A run id that no longer exists on the server cannot be told apart offline (no
server to ask: W&B finds out at ``wandb sync``, Comet at ``comet upload``), so that case is
not tested here.

Each job costs seconds (wandb's service, Comet's archive), so one job logs to both.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, ProjectConfiguration
from accelkit.trackers.backends.comet_ml import CometMLTracker, _experiment_elsewhere
from accelkit.trackers.backends.wandb import WandBTracker
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job

RESUMED = "accelkit/resumed_at_step"


def _job(
    jobs: Preloaded, project: Path, *args: str, killed: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the resume job logging to wandb and comet_ml; check how it ended. (Comet keeps an
    experiment's messages in a temporary folder until end(): the killed job's stays behind in
    the ``jobs`` fixture's TMPDIR, in the session's folder.)"""
    done = run_job(
        jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
        "--log-with", "wandb,comet_ml", *args, timeout=300,
    )  # fmt: skip
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _manifest(project: Path, number: int) -> dict[str, Any]:
    path = project / "checkpoints" / f"checkpoint_{number}" / "accelkit.json"
    return dict(json.loads(path.read_text())["experiment"])


# ---------------------------------------------------------------------------------- W&B files


def _wandb_runs(project: Path, last: int = 0) -> list[dict[str, Any]]:
    """The offline run folders (the ``last`` ones, or all), oldest first, decoded with wandb's
    own reader."""
    folders = sorted(glob.glob(str(project / "wandb" / "offline-run-*")))[-last:]
    return [_read_wandb_file(glob.glob(os.path.join(f, "run-*.wandb"))[0]) for f in folders]


def _read_wandb_file(path: str) -> dict[str, Any]:
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", path],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    run: dict[str, Any] = {"file": os.path.basename(path), "config": {}, "summary": {}}
    rows: list[dict[str, Any]] = []
    for line in out.stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        kind = record.get("type")
        if kind == "run":
            run["run"] = record["run"]
        elif kind == "config":
            run["config"].update(record["config"].get("update", {}))
        elif kind == "summary":
            run["summary"].update(record["summary"].get("update", {}))
        elif kind == "history":
            rows.append(record["history"]["item"])
    run["rows"] = rows
    run["loss"] = [(row["_step"], row["loss"]) for row in rows if "loss" in row]
    return run


def _checkpoint_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in run["rows"] if "checkpoint/step" in row]


# -------------------------------------------------------------------------------- Comet archives


def _comet_archives(project: Path) -> list[tuple[str, dict[str, Any] | None, list[dict[str, Any]]]]:
    """Each offline archive: (file name, experiment.json or None when empty, messages)."""
    found = []
    for path in sorted(glob.glob(str(project / "comet_ml" / "*.zip")), key=os.path.getmtime):
        with zipfile.ZipFile(path) as archive:
            if "experiment.json" not in archive.namelist():
                found.append((os.path.basename(path), None, []))
                continue
            experiment = json.loads(archive.read("experiment.json"))
            lines = archive.read("messages.json").decode().splitlines()
        found.append((os.path.basename(path), experiment, [json.loads(line) for line in lines]))
    return found


def _comet_metrics(messages: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    return [
        (m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"])
        for m in messages
        if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"] == name
    ]


def _comet_others(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"
    }


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("order", "then"), [("init-first", "crafted-reference"), ("load-first", "no-continue")]
)
def test_killed_job_continues_the_wandb_run_and_the_comet_experiment(
    tmp_path: Path, jobs: Preloaded, order: str, then: str
) -> None:
    project = tmp_path / "project"
    _job(jobs, project, "--kill-at", "150", "--order", order, killed=True)
    experiment = _manifest(project, 0)
    assert experiment["step"] == 100
    wandb_ref, comet_ref = experiment["runs"]["wandb"], experiment["runs"]["comet_ml"]
    assert wandb_ref["project"] == comet_ref["project"] == "run"
    # The resumed job runs to step 200 and saves there (checkpoint_1).
    _job(jobs, project, "--resume", "--attempt", "1", "--order", order, "--steps", "201")
    assert _manifest(project, 1)["runs"] == experiment["runs"]
    _check_wandb_continued(project, wandb_ref["run_id"])
    _check_comet_continued(project, comet_ref["experiment_key"])
    if then == "crafted-reference":
        _check_crafted_reference(jobs, project, wandb_ref["run_id"], comet_ref["experiment_key"])
    else:
        # Opting out: the same checkpoint, a new W&B run and a new Comet experiment.
        _job(jobs, project, "--resume", "--attempt", "2", "--no-continue", "--steps", "205")
        _check_new_runs(project, wandb_ref["run_id"], comet_ref["experiment_key"])


def _check_wandb_continued(project: Path, run_id: str) -> None:
    # Two offline folders (one per process) holding one run id, the checkpoint's.
    first, resumed = _wandb_runs(project)
    assert first["file"] == resumed["file"] == f"run-{run_id}.wandb"
    assert first["run"]["run_id"] == resumed["run"]["run_id"] == run_id
    assert resumed["run"].get("resume") is True
    assert resumed["config"][RESUMED] == 100 and RESUMED not in first["config"]
    # The first attempt's points up to the kill (wandb may lose its last buffered rows to
    # SIGKILL), each once; the resumed run holds 101..200 once, with the resumed values.
    assert [step for step, _ in first["loss"]] == list(range(len(first["loss"])))
    assert len(first["loss"]) > 101 and all(value == step for step, value in first["loss"])
    assert resumed["loss"] == [(step, step + 1000.0) for step in range(101, 201)]
    # Each save joined the user's row of its step; the load joined the first resumed row
    # (the offline run counts from 0 again); all are plotted at their checkpoint/step.
    (saved,) = _checkpoint_rows(first)
    assert saved["_step"] == 100 and saved["loss"] == 100 and saved["checkpoint/step"] == 100
    assert saved["checkpoint/bytes"] > 0 and saved["checkpoint/iteration"] == 0
    assert first["summary"]["checkpoint/latest"].endswith("checkpoints/checkpoint_0")
    loaded, saved = _checkpoint_rows(resumed)
    assert loaded["_step"] == 101 and loaded["loss"] == 1101
    assert loaded["checkpoint/step"] == loaded["checkpoint/resumed_step"] == 100
    assert saved["_step"] == saved["checkpoint/step"] == 200 and saved["loss"] == 1200
    assert saved["checkpoint/save_seconds"] >= saved["checkpoint/blocking_seconds"] > 0
    assert resumed["summary"]["checkpoint/resumed_from"].endswith("checkpoints/checkpoint_0")
    assert resumed["summary"]["checkpoint/latest"].endswith("checkpoints/checkpoint_1")


def _check_comet_continued(project: Path, key: str) -> None:
    # The killed process left at most an empty archive (Comet writes it at the end; whether
    # the empty file exists depends on how long its run had been open when SIGKILL came, and
    # a save no longer waits for the run to open); the resumed one continues the same key.
    *killed, (resumed_name, meta, messages) = _comet_archives(project)
    assert len(killed) <= 1 and all(m is None and n.startswith(key) for n, m, _ in killed)
    assert resumed_name.startswith(key)
    assert meta is not None and meta["offline_id"] == key and meta["project_name"] == "run"
    assert meta["resume_strategy"] == "get_or_create" and meta["user_provided_experiment_key"]
    assert _comet_metrics(messages, "loss") == [(s, s + 1000.0) for s in range(101, 201)]
    others = _comet_others(messages)
    assert others[RESUMED] == 100
    assert others["checkpoint/resumed_from"].endswith("checkpoints/checkpoint_0")
    assert others["checkpoint/latest"].endswith("checkpoints/checkpoint_1")
    assert _comet_metrics(messages, "checkpoint/resumed_step") == [(100, 100.0)]
    assert [step for step, _ in _comet_metrics(messages, "checkpoint/bytes")] == [200]


def _check_crafted_reference(jobs: Preloaded, project: Path, run_id: str, key: str) -> None:
    """A manifest edited to point elsewhere: another W&B project (and entity) with the real
    run id, a Comet key that is a path. Neither is followed; the job runs to its end."""
    path = project / "checkpoints" / "checkpoint_1" / "accelkit.json"
    manifest = json.loads(path.read_text())
    runs = manifest["experiment"]["runs"]
    runs["wandb"] = {"run_id": run_id, "project": "elsewhere", "entity": "someone-else"}
    runs["comet_ml"] = {"experiment_key": "../../" + key, "project": "run"}
    path.write_text(json.dumps(manifest))
    done = _job(jobs, project, "--resume", "--attempt", "2", "--steps", "205")
    assert "belongs to project 'elsewhere'" in done.stderr
    assert "is not an experiment key" in done.stderr
    _check_new_runs(project, run_id, key)


def _check_new_runs(project: Path, run_id: str, key: str) -> None:
    """The third process (resumed from checkpoint_1) logged 201..204 to a new run."""
    (fresh,) = _wandb_runs(project, last=1)
    assert fresh["run"]["run_id"] != run_id and fresh["run"]["project"] == "run"
    assert RESUMED not in fresh["config"] and not fresh["run"].get("resume")
    assert fresh["loss"] == [(step, step + 2000.0) for step in range(201, 205)]
    *_, (_, meta, messages) = _comet_archives(project)
    assert meta is not None and meta["offline_id"] != key
    assert RESUMED not in _comet_others(messages)
    assert _comet_metrics(messages, "loss") == [(s, s + 2000.0) for s in range(201, 205)]


# In-process checks of the reference validation (no subprocess: only the tracker's own start).

BAD_WANDB_REFERENCES = [
    {"run_id": None, "project": "p"},
    {"run_id": 12345678, "project": "p"},
    {"run_id": "", "project": "p"},
    {"run_id": "../etc/x", "project": "p"},
    {"run_id": "a" * 129, "project": "p"},
    {"project": "p"},
]


def test_wandb_ignores_bad_references_and_lets_the_users_id_win(
    tmp_path: Path, workdir: Path
) -> None:
    tracker = WandBTracker("p", str(tmp_path / "a"))
    for reference in BAD_WANDB_REFERENCES:
        with pytest.warns(UserWarning, match="is not a run id"):
            tracker.continue_run(reference, 100)
    with pytest.warns(UserWarning, match="belongs to project 'other'"):
        tracker.continue_run({"run_id": "abc12345", "project": "other"}, 100)
    # A crafted value is shown cut short, not copied whole into the log.
    with pytest.warns(UserWarning, match="is not a run id") as said:
        tracker.continue_run({"run_id": "\x1b[2J" + "x" * 100_000, "project": "p"}, 100)
    assert len(str(said[0].message)) < 400 and "\x1b" not in str(said[0].message)
    tracker.start()
    try:
        assert tracker.run.id != "abc12345" and RESUMED not in dict(tracker.run.config)
    finally:
        tracker.finish()

    # init_kwargs naming the run win over the checkpoint (no warning, no resume point).
    own = WandBTracker("p", str(tmp_path / "b"), id="mine0001")
    own.continue_run({"run_id": "abc12345", "project": "p"}, 100)
    own.start()
    try:
        assert own.run.id == "mine0001" and RESUMED not in dict(own.run.config)
    finally:
        own.finish()
    assert not list(workdir.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wandb", "comet_ml"])
def test_an_instance_started_by_init_trackers_leaves_no_offline_run_after_a_load(
    tmp_path: Path, workdir: Path, name: str
) -> None:
    """Issue #41 item 5: an instance is started by init_trackers, as Accelerate starts it; a
    load_state before anything was logged gives its new run up for the checkpoint's, and
    the offline run it wrote (its configuration only) is deleted."""
    project = tmp_path / "project"
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    first = Accelerator(log_with=name, project_config=config)
    first.init_trackers("run")
    first.log({"loss": 1.0}, step=0)
    first.save_state()
    first.end_training()
    reference = _manifest(project, 0)["runs"][name]

    kind = WandBTracker if name == "wandb" else CometMLTracker
    tracker = kind("run", str(project))
    second = Accelerator(log_with=tracker, project_config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is left behind: no warning
        second.init_trackers("run", config={"lr": 0.1})
        opened = tracker.run.id if name == "wandb" else tracker.experiment.get_key()
        second.load_state()
    second.log({"loss": 2.0})
    second.end_training()
    if name == "wandb":
        assert opened != reference["run_id"]
        ids = {run["run"]["run_id"] for run in _wandb_runs(project)}
        assert ids == {reference["run_id"]}  # the folder of the run opened at init is gone
    else:
        assert opened != reference["experiment_key"]
        names = [archive for archive, _, _ in _comet_archives(project)]
        assert not [archive for archive in names if archive.startswith(opened)], names
        assert any(archive.startswith(reference["experiment_key"]) for archive in names)
    assert not list(workdir.iterdir())


def test_comet_ignores_bad_references(tmp_path: Path, workdir: Path) -> None:
    tracker = CometMLTracker("p", str(tmp_path))
    key = "a" * 32
    for reference in [
        {"experiment_key": None, "project": "p"},
        {"experiment_key": "a" * 31, "project": "p"},
        {"experiment_key": "a" * 51, "project": "p"},
        {"experiment_key": "a" * 30 + "/..", "project": "p"},
        {"project": "p"},
    ]:
        with pytest.warns(UserWarning, match="is not an experiment key"):
            tracker.continue_run(reference, 100)
    with pytest.warns(UserWarning, match="belongs to project 'other'"):
        tracker.continue_run({"experiment_key": key, "project": "other"}, 100)
    tracker.start()
    try:
        assert tracker.experiment.get_key() != key
        assert tracker.run_reference() == {"experiment_key": tracker.experiment.get_key(),
                                           "project": "p"}  # fmt: skip
    finally:
        tracker.finish()


class _ServerExperiment:
    def __init__(self, workspace: str, project_name: str) -> None:
        self.workspace, self.project_name = workspace, project_name


class _CometServer:
    """Answers as ``comet_ml.API`` does for two calls (no Comet server is reachable here)."""

    def __init__(self, experiments: dict[str, _ServerExperiment]) -> None:
        self.experiments = experiments

    def get_experiment_by_key(self, key: str) -> _ServerExperiment | None:
        return self.experiments.get(key)

    def get_default_workspace(self) -> str:
        return "me"


def test_comet_online_continues_only_an_experiment_of_this_workspace_and_project() -> None:
    key = "b" * 32
    here = _CometServer({key: _ServerExperiment("me", "Run")})
    assert _experiment_elsewhere(here, key, None, "run") is None
    assert _experiment_elsewhere(here, key, "me", "run") is None
    # Not on the server: the checkpoint named it before its job's experiment got there (a job
    # killed while comet_ml.start was running); it is created there with that key.
    assert _experiment_elsewhere(_CometServer({}), key, None, "run") is None
    other_project = _CometServer({key: _ServerExperiment("me", "secret")})
    assert "me/secret" in str(_experiment_elsewhere(other_project, key, None, "run"))
    other_workspace = _CometServer({key: _ServerExperiment("team", "run")})
    assert "team/run" in str(_experiment_elsewhere(other_workspace, key, None, "run"))
    assert "not in this run's team/run" in str(_experiment_elsewhere(here, key, "team", "run"))
