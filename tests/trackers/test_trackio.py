"""trackio, for real and offline: a resumed job continues the same run, and ``accelkit track
sync`` backfills what an outage kept in the journal into that same run. Every value is read
back from trackio's local database with trackio's own ``SQLiteStorage``."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from accelkit import Accelerator, ProjectConfiguration
from accelkit.cli.main import main as cli
from accelkit.trackers import TrackerWarning, register_tracker
from accelkit.trackers.backends.trackio import TrackioTracker
from accelkit.trackers.delivery.journal import JournalWarning
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job
from tests.trackers.readers import trackio_logs


def _losses(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def _job(jobs: Preloaded, project: Path, *args: str, killed: bool = False) -> None:
    done = run_job(
        jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
        "--log-with", "trackio", *args, timeout=300,
    )  # fmt: skip
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_killed_job_resumes_into_the_same_trackio_run_each_step_once(
    tmp_path: Path, jobs: Preloaded
) -> None:
    project = tmp_path / "project"
    _job(jobs, project, "--kill-at", "150", killed=True)
    first = trackio_logs(str(project), "run")
    (name,) = first
    # What the killed attempt left: steps 0..150, the ones after the checkpoint included.
    assert _losses(first[name])[-1] == (150, 150.0)
    manifest = json.loads((project / "checkpoints" / "checkpoint_0" / "accelkit.json").read_text())[
        "experiment"
    ]
    assert manifest["runs"]["trackio"]["name"] == name == f"accelkit-{manifest['key']}"

    _job(jobs, project, "--resume", "--attempt", "1")
    runs = trackio_logs(str(project), "run")
    assert list(runs) == [name]  # the same run, no second one
    expected = [(s, float(s)) for s in range(101)] + [(s, s + 1000.0) for s in range(101, 200)]
    assert sorted(_losses(runs[name])) == expected


def test_a_reference_from_another_project_starts_a_new_run() -> None:
    tracker = TrackioTracker("mine")
    assert tracker.name_run("k" * 32) == {"project": "mine", "name": "accelkit-" + "k" * 32}
    with pytest.warns(UserWarning, match=r"belongs to project 'theirs'.*new run"):
        tracker.continue_run({"project": "theirs", "name": "accelkit-x"}, 3)
    assert tracker._resume_step is None and tracker._name is None
    with pytest.warns(UserWarning, match=r"is not a trackio run name"):
        tracker.continue_run({"project": "mine", "name": "../../etc"}, 3)
    assert tracker._resume_step is None


class FlakyTrackio(TrackioTracker):
    """trackio behind a network that is down while a ``DOWN`` file is in the logging dir."""

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if os.path.exists(os.path.join(self.logging_dir or ".", "DOWN")):
            raise ConnectionError("connection refused (the test's outage)")
        super().log(values, step, **kwargs)


@pytest.mark.slow
def test_track_sync_backfills_the_missing_steps_into_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.001")
    monkeypatch.setenv("ACCELKIT_TRACKER_DRAIN_S", "0.2")
    register_tracker(FlakyTrackio, overwrite=True)
    accelerator = Accelerator(
        log_with="trackio", project_config=ProjectConfiguration(project_dir=str(tmp_path))
    )
    accelerator.init_trackers("run", init_kwargs={"trackio": {"auto_log_cpu": False}})
    for step in range(5):
        accelerator.log({"loss": float(step)}, step=step)
    accelerator.get_tracker("trackio")  # flushed: steps 0-4 delivered
    (tmp_path / "DOWN").touch()
    for step in range(5, 40):
        accelerator.log({"loss": float(step)}, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackerWarning)
        accelerator.end_training()
    # The run was left open (its backend was down at the end): trackio's sender thread writes
    # what it accepted (steps 0-4) within its batch interval.
    deadline = time.monotonic() + 60
    while not any(trackio_logs(str(tmp_path), "run").values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    ((name, rows),) = trackio_logs(str(tmp_path), "run").items()
    assert _losses(rows) == [(s, float(s)) for s in range(5)]

    (tmp_path / "DOWN").unlink()
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli(["track", "sync", str(tmp_path), "--tracker", "trackio"]) == 0
    # The entry being sent when the backend went down is settled by asking trackio's database
    # (journal_delivered), not sent again with a warning that it may appear twice.
    assert not [w for w in caught if issubclass(w.category, JournalWarning)]
    assert "trackio: sent 35 entries" in capsys.readouterr().out
    runs = trackio_logs(str(tmp_path), "run")
    assert list(runs) == [name]
    assert _losses(runs[name]) == [(s, float(s)) for s in range(40)]


@pytest.mark.slow
def test_log_images_stores_trackio_images_under_the_logging_dir(tmp_path: Path) -> None:
    import numpy as np
    import torch

    accelerator = Accelerator(log_with="trackio", project_dir=str(tmp_path))
    accelerator.init_trackers("images", init_kwargs={"trackio": {"auto_log_cpu": False}})
    tracker = accelerator.get_tracker("trackio")
    chw = torch.rand(3, 8, 6)
    tracker.log_images({"sample": chw, "pair": [np.zeros((4, 5, 3), np.uint8)] * 2}, step=3)
    accelerator.end_training()

    ((_, rows),) = trackio_logs(str(tmp_path), "images").items()
    (row,) = rows
    assert row["step"] == 3 and {"sample", "pair/0", "pair/1"} <= set(row)
    from PIL import Image

    media = tmp_path / "trackio" / "media"
    stored = media / row["sample"]["file_path"]
    assert Image.open(stored).size == (6, 8)  # CHW became an 8x6 image
    assert Image.open(media / row["pair/1"]["file_path"]).size == (5, 4)
