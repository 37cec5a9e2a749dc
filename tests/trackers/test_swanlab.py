"""SwanLab, for real and offline (no API key): a resumed job continues the same run id, ``accelkit
track sync`` backfills what an outage kept in the journal into that run, and images are stored.
Every value is read back from SwanLab's run files with SwanLab's own ``DataStoreReader``."""

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
from accelkit.trackers import TrackerWarning, register_tracker
from accelkit.trackers.backends.swanlab import RESUMED_AT_STEP, SwanLabTracker
from accelkit.trackers.delivery.journal import JournalWarning
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job
from tests.trackers.readers import swanlab_runs


def _job(jobs: Preloaded, project: Path, *args: str, killed: bool = False) -> None:
    done = run_job(
        jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
        "--log-with", "swanlab", *args, timeout=300,
    )  # fmt: skip
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_killed_job_resumes_into_the_same_swanlab_run_id(tmp_path: Path, jobs: Preloaded) -> None:
    project = tmp_path / "project"
    _job(jobs, project, "--kill-at", "150", killed=True)
    manifest = json.loads((project / "checkpoints" / "checkpoint_0" / "accelkit.json").read_text())[
        "experiment"
    ]
    assert manifest["runs"]["swanlab"] == {"run_id": manifest["key"], "project": "run"}

    _job(jobs, project, "--resume", "--attempt", "1")
    first, resumed = swanlab_runs(str(project))
    # Offline, the resumed job writes a second folder with the same run id: `swanlab sync`
    # of both appends to one experiment.
    assert first["id"] == resumed["id"] == manifest["key"]
    assert resumed["config"][RESUMED_AT_STEP] == 100
    assert resumed["scalars"]["loss"] == [(s, s + 1000.0) for s in range(101, 200)]
    # The killed attempt's file ends where SIGKILL cut it (SwanLab writes it from a background
    # thread: often before its first record, so it may hold no point): its points are attempt
    # 0's.
    killed = first["scalars"].get("loss", [])
    assert killed == [(s, float(s)) for s in range(len(killed))] and not resumed["torn"]


def test_a_reference_from_another_project_starts_a_new_run() -> None:
    tracker = SwanLabTracker("mine")
    assert tracker.name_run("k" * 32) == {"run_id": "k" * 32, "project": "mine"}
    with pytest.warns(UserWarning, match=r"belongs to project 'theirs'.*new run"):
        tracker.continue_run({"project": "theirs", "run_id": "abc"}, 3)
    assert tracker._resume_step is None and tracker._key is None
    with pytest.warns(UserWarning, match=r"is not a SwanLab run id"):
        tracker.continue_run({"project": "mine", "run_id": "../x"}, 3)
    assert tracker._resume_step is None


class FlakySwanLab(SwanLabTracker):
    """SwanLab behind a network that is down while a ``DOWN`` file is in the logging dir."""

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
    register_tracker(FlakySwanLab, overwrite=True)
    accelerator = Accelerator(
        log_with="swanlab", project_config=ProjectConfiguration(project_dir=str(tmp_path))
    )
    accelerator.init_trackers("run")
    for step in range(5):
        accelerator.log({"loss": float(step)}, step=step)
    accelerator.get_tracker("swanlab")  # flushed: steps 0-4 delivered
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
        assert cli(["track", "sync", str(tmp_path), "--tracker", "swanlab"]) == 0
    # The entry being sent when the backend went down is settled by reading the run's files
    # (journal_delivered), not sent again with a warning that it may appear twice.
    assert not [w for w in caught if issubclass(w.category, JournalWarning)]
    assert "swanlab: sent 35 entries" in capsys.readouterr().out
    first, synced = swanlab_runs(str(tmp_path))
    assert first["id"] == synced["id"]  # the same run: `swanlab sync` appends the backfill
    assert synced["scalars"]["loss"] == [(s, float(s)) for s in range(5, 40)]


@pytest.mark.slow
def test_log_images_stores_swanlab_images(tmp_path: Path) -> None:
    import numpy as np
    import torch

    accelerator = Accelerator(log_with="swanlab", project_dir=str(tmp_path))
    accelerator.init_trackers("images")
    tracker = accelerator.get_tracker("swanlab")
    pair = [np.zeros((4, 5, 3)), np.full((4, 5, 3), 200, np.uint8)]
    tracker.log_images({"sample": torch.rand(3, 8, 6), "pair": pair}, step=3)
    accelerator.end_training()

    (run,) = swanlab_runs(str(tmp_path))
    assert run["media"] == {"sample": [3], "pair": [3]}
    stored = list((tmp_path / "swanlog").glob("run-*/media/**/*.png"))
    assert len(stored) == 3, stored
