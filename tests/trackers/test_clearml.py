"""ClearML, for real and offline (``CLEARML_OFFLINE_MODE=1``, set for every tracker test): ten
points logged and read back, Accelerate's titles and series, the session under the logging
directory (nothing in the working directory or ``$HOME``), a resumed job continuing the same
task, ``accelkit track sync`` backfilling the same task, images and tables, and the refusal to
start online with no server configured. Every value is read back from ClearML's offline
session (``task.json``, ``metrics.jsonl``; the configuration with ClearML's own parser)."""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from accelkit import Accelerator, ProjectConfiguration
from accelkit.cli.main import main as cli
from accelkit.errors import ConfigurationError
from accelkit.trackers import TrackerWarning, register_tracker
from accelkit.trackers.backends.clearml import RESUMED_AT_STEP, ClearMLTracker, title_series
from accelkit.trackers.delivery.journal import JournalWarning
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job
from tests.trackers.readers import clearml_sessions

OFFLINE_ID = "offline-" + "0123456789abcdef" * 2


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``$HOME``: ClearML writing there (its session cache) shows up here."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    return folder


def test_ten_points_are_read_back_from_the_offline_session(
    tmp_path: Path, workdir: Path, home: Path
) -> None:
    project = tmp_path / "project"
    accelerator = Accelerator(log_with="clearml", project_dir=str(project))
    accelerator.init_trackers("ten", config={"lr": 0.1, "model": {"layers": [4, 2]}})
    for step in range(10):
        accelerator.log(
            {"train_loss": float(step), "eval_acc": step / 10, "grad": 2.0 * step}, step=step
        )
    tracker = accelerator.get_tracker("clearml")
    tracker.log({"final": 3.0})  # no step: a single value, as Accelerate reports it
    reference = tracker.run_reference()
    accelerator.end_training()

    (session,) = clearml_sessions(str(project))
    assert reference == {"task_id": session["id"], "project": "ten"}
    assert (session["project"], session["name"], session["zipped"]) == ("ten", "ten", True)
    # Accelerate's titles and series: "train_loss" is title "loss" in series "train".
    assert session["scalars"] == {
        "loss": [(s, float(s)) for s in range(10)],
        "eval_acc": [(s, s / 10) for s in range(10)],
        "grad": [(s, 2.0 * s) for s in range(10)],
    }
    assert session["single"] == {"final": 3.0}
    assert session["config"] == {"lr": 0.1, "model": {"layers": [4, 2]}}
    assert sorted(os.listdir(workdir)) == [] and sorted(os.listdir(home)) == []


def test_a_process_started_after_another_closed_its_task_still_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ClearML's mark of a parent process whose task is closed: with it, Task.init would hand
    # back a stub task that drops every value.
    monkeypatch.setenv("CLEARML_PROC_MASTER_ID", "1:")
    accelerator = Accelerator(log_with="clearml", project_dir=str(tmp_path))
    accelerator.init_trackers("child")
    accelerator.log({"loss": 0.5}, step=7)
    accelerator.end_training()
    (session,) = clearml_sessions(str(tmp_path))
    assert session["scalars"] == {"loss": [(7, 0.5)]}


def test_a_task_the_script_opened_is_used_and_left_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from clearml import Task

    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "own" / "clearml"))
    # What a clearml.conf with sdk.development.report_use_subprocess: false does (the
    # subprocess reporter's close waits ~10 s).
    monkeypatch.setattr(Task, "_report_subprocess_enabled", False)
    opened: list[Any] = []
    # The script's own Task.init (in a thread: ClearML would take the test process's signals).
    worker = threading.Thread(
        target=lambda: opened.append(Task.init("own", "script", reuse_last_task_id=False))
    )
    worker.start()
    worker.join()
    (task,) = opened
    try:
        accelerator = Accelerator(log_with="clearml", project_dir=str(tmp_path / "project"))
        accelerator.init_trackers("ignored")
        accelerator.log({"loss": 1.5}, step=2)
        assert accelerator.get_tracker("clearml", unwrap=True) is task
        accelerator.end_training()
        assert Task.current_task() is task  # left open, as Accelerate leaves it
    finally:
        task.close()
    (session,) = clearml_sessions(str(tmp_path / "own"))
    assert (session["id"], session["project"]) == (task.id, "own")
    assert session["scalars"] == {"loss": [(2, 1.5)]}
    assert not (tmp_path / "project" / "clearml").exists()


def test_title_series_is_accelerates() -> None:
    assert title_series("train_loss") == ("loss", "train")
    assert title_series("eval_f1") == ("f1", "eval")
    assert title_series("test_acc") == ("acc", "test")
    assert title_series("trainloss") == ("trainloss", "train")


def _job(project: Path) -> Accelerator:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    return Accelerator(log_with="clearml", project_config=config)


def test_a_resumed_job_continues_the_same_task_without_the_points_after_the_checkpoint(
    tmp_path: Path, workdir: Path, home: Path
) -> None:
    project = tmp_path / "project"
    first = _job(project)
    first.init_trackers("resume", config={"lr": 0.1})
    for step in range(6):
        first.log({"loss": float(step)}, step=step)
    first.save_state()  # covers steps 0-5
    for step in range(6, 9):  # the timeline the resumed job replaces
        first.log({"loss": -1.0}, step=step)
    saved = first.get_tracker("clearml").run_reference()
    first.end_training()

    resumed = _job(project)
    resumed.init_trackers("resume", config={"lr": 0.1})
    resumed.load_state()
    for step in range(6, 10):
        resumed.log({"loss": 100.0 + step}, step=step)
    continued = resumed.get_tracker("clearml").run_reference()
    resumed.end_training()

    assert continued == saved
    (session,) = clearml_sessions(str(project))  # one task, one session folder
    assert session["id"] == saved["task_id"]
    # Same iterations (no offset), and none of the first attempt's points after step 5.
    assert session["scalars"]["loss"] == [(s, float(s)) for s in range(6)] + [
        (s, 100.0 + s) for s in range(6, 10)
    ]
    assert session["config"] == {"lr": 0.1, RESUMED_AT_STEP: 5}
    assert sorted(os.listdir(home)) == []


@pytest.mark.slow
def test_a_killed_job_resumes_into_the_same_task(tmp_path: Path, jobs: Preloaded) -> None:
    project = tmp_path / "project"

    def job(*args: str, killed: bool = False) -> None:
        done = run_job(
            jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
            "--log-with", "clearml", *args, timeout=300,
        )  # fmt: skip
        expected = -signal.SIGKILL if killed else 0
        assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]

    job("--kill-at", "150", killed=True)  # the session has steps 0-150, no .zip
    manifest = json.loads((project / "checkpoints" / "checkpoint_0" / "accelkit.json").read_text())
    saved = manifest["experiment"]["runs"]["clearml"]
    job("--resume", "--attempt", "1")

    (session,) = clearml_sessions(str(project))
    assert saved == {"task_id": session["id"], "project": "run"} and session["zipped"]
    # Each step once: attempt 0's up to the checkpoint (step 100), then attempt 1's.
    assert session["scalars"]["loss"] == [(s, float(s)) for s in range(101)] + [
        (s, s + 1000.0) for s in range(101, 200)
    ]
    assert session["config"][RESUMED_AT_STEP] == 100


def test_an_instance_given_up_for_the_checkpoints_task_leaves_no_session(tmp_path: Path) -> None:
    project = tmp_path / "project"
    first = _job(project)
    first.init_trackers("job")
    first.log({"loss": 1.0}, step=0)
    first.save_state()
    saved = first.get_tracker("clearml").run_reference()
    first.end_training()

    # An instance is started by init_trackers (as in Accelerate), then load_state moves it to
    # the checkpoint's task: the empty task it opened first is deleted, not left behind.
    tracker = ClearMLTracker("job", logging_dir=str(project))
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    resumed = Accelerator(log_with=[tracker], project_config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.init_trackers("job", config={"lr": 0.1})
        opened = tracker.run_reference()
        resumed.load_state()
        resumed.log({"loss": 2.0})
        resumed.end_training()
    assert not [w for w in caught if "kept" in str(w.message)], [str(w.message) for w in caught]

    assert opened is not None and opened != saved
    (session,) = clearml_sessions(str(project))
    assert session["id"] == saved["task_id"]
    assert session["scalars"]["loss"] == [(0, 1.0), (1, 2.0)]
    assert not list((project / "clearml" / "offline").glob(opened["task_id"] + "*"))


def test_a_fork_opens_a_new_task_that_names_the_checkpoints(tmp_path: Path) -> None:
    first = _job(tmp_path / "a")
    first.init_trackers("fork", config={"lr": 0.1})
    for step in range(3):
        first.log({"loss": float(step)}, step=step)
    checkpoint = first.save_state()
    parent = first.get_tracker("clearml").run_reference()
    first.end_training()

    child = _job(tmp_path / "b")
    child.init_trackers("fork", config={"lr": 0.2})
    child.load_state(checkpoint, fork=True)
    child.log({"loss": 10.0})
    child.end_training()

    (before,) = clearml_sessions(str(tmp_path / "a"))
    (forked,) = clearml_sessions(str(tmp_path / "b"))
    assert before["id"] == parent["task_id"] != forked["id"]
    assert before["scalars"]["loss"] == [(s, float(s)) for s in range(3)]  # left as it was
    assert forked["scalars"]["loss"] == [(3, 10.0)]  # counts on from the checkpoint's step
    # Offline, ClearML's task parent stays empty (the server the session is imported into
    # does not know an offline id): the forked_from entry names the checkpoint's task.
    assert forked["parent"] is None
    assert forked["config"]["forked_from"]["runs"]["clearml"] == parent
    assert forked["config"]["lr"] == 0.2


def test_a_reference_from_elsewhere_starts_a_new_task(tmp_path: Path) -> None:
    tracker = ClearMLTracker("mine", logging_dir=str(tmp_path))
    cases = {
        "belongs to project 'theirs'": {"project": "theirs", "task_id": OFFLINE_ID},
        "is not an offline ClearML task id": {"project": "mine", "task_id": "../x"},
        "is not an offline ClearML task id ": {"project": "mine", "task_id": "0" * 32},
        "has no session in": {"project": "mine", "task_id": OFFLINE_ID},
    }
    for message, reference in cases.items():
        with pytest.warns(UserWarning, match=message.strip()):
            tracker.continue_run(reference, 3)
        assert (tracker._continue, tracker._resume_step) == (None, None), reference
    # The script's own choice wins over the checkpoint, without a warning.
    own = ClearMLTracker("mine", logging_dir=str(tmp_path), continue_last_task=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own.continue_run({"project": "mine", "task_id": OFFLINE_ID}, 3)
    assert own._continue is None


# A fresh process: ClearML reads CLEARML_OFFLINE_MODE once, when imported.
_ONLINE_JOB = """
import os, sys
os.environ.pop("CLEARML_OFFLINE_MODE")
os.environ["HOME"] = sys.argv[2]
from clearml import Task
from accelkit.errors import ConfigurationError
from accelkit.trackers.backends.clearml import ClearMLTracker
tracker = ClearMLTracker("online", logging_dir=sys.argv[1])
try:
    tracker.start()
except ConfigurationError as error:
    print("REFUSED", error)
print("OPEN", tracker.task is not None or Task.current_task() is not None)
"""


@pytest.mark.slow
def test_online_without_a_server_is_refused_with_the_fix(
    tmp_path: Path, jobs: Preloaded, home: Path
) -> None:
    done = run_job(jobs, "-c", _ONLINE_JOB, str(tmp_path / "logs"), str(home), timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "REFUSED ClearML has no server configured" in done.stdout, done.stdout
    for fix in ("CLEARML_OFFLINE_MODE=1", "clearml-init", "CLEARML_API_ACCESS_KEY"):
        assert fix in done.stdout, fix
    assert "OPEN False" in done.stdout
    assert sorted(os.listdir(home)) == []


def test_log_images_and_log_table_are_stored(tmp_path: Path) -> None:
    import numpy as np
    import torch

    accelerator = Accelerator(log_with="clearml", project_dir=str(tmp_path))
    accelerator.init_trackers("media")
    tracker = accelerator.get_tracker("clearml")
    pair = [np.zeros((4, 5, 3)), np.full((4, 5, 3), 200, np.uint8)]
    tracker.log_images({"eval_sample": torch.rand(3, 8, 6), "pair": pair}, step=3)
    tracker.log_table("eval_preds", columns=["x", "y"], data=[[1, 2], [3, 4]], step=2)
    with pytest.raises(ConfigurationError, match=r"log_table\('empty'\) got no rows.*data="):
        tracker.log_table("empty")
    accelerator.end_training()

    (session,) = clearml_sessions(str(tmp_path))
    assert session["images"] == {
        ("sample", "eval"): [3],
        ("pair", "train/0"): [3],
        ("pair", "train/1"): [3],
    }
    assert session["tables"] == {"eval_preds": [2]}
    stored = list((tmp_path / "clearml" / "offline").glob("offline-*/data/**/*.jpeg"))
    assert len(stored) == 3, stored


class FlakyClearML(ClearMLTracker):
    """ClearML behind a network that is down while a ``DOWN`` file is in the logging dir."""

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if os.path.exists(os.path.join(self.logging_dir or ".", "DOWN")):
            raise ConnectionError("connection refused (the test's outage)")
        super().log(values, step, **kwargs)


def test_track_sync_backfills_the_missing_steps_into_the_same_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.001")
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "0.2")
    register_tracker(FlakyClearML, overwrite=True)
    accelerator = Accelerator(
        log_with="clearml", project_config=ProjectConfiguration(project_dir=str(tmp_path))
    )
    accelerator.init_trackers("run")
    for step in range(5):
        accelerator.log({"loss": float(step)}, step=step)
    accelerator.get_tracker("clearml")  # flushed: steps 0-4 delivered
    (tmp_path / "DOWN").touch()
    for step in range(5, 40):
        accelerator.log({"loss": float(step)}, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        accelerator.end_training()

    (tmp_path / "DOWN").unlink()
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli(["track", "sync", str(tmp_path), "--tracker", "clearml"]) == 0
    # The entry in doubt is settled by reading the session (journal_delivered), not resent.
    assert not [w for w in caught if issubclass(w.category, JournalWarning)]
    assert "clearml: sent 35 entries" in capsys.readouterr().out
    (session,) = clearml_sessions(str(tmp_path))  # the same task, one session
    assert session["scalars"]["loss"] == [(s, float(s)) for s in range(40)]
