"""The DVCLive tracker against the real ``dvclive`` package: a resumed run continues the same
folder with each step once, images land per step, Accelerate's ways of configuring it work,
and nothing leaves the folder it was given. The shipped contract runs in
``test_conformance.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.trackers.backends._files import TrackerFileError
from accelkit.trackers.backends.dvclive import DVCLiveTracker
from tests.trackers.readers import dvclive_metrics

pytest.importorskip("dvclive", reason="dvclive (accelkit[dvclive]) is not installed")


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Out of this repository's checkout: DVCLive reaches for the Git repository around the
    # working directory (the test below shows accelkit's tracker does not).
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _job(project: Path, steps: range, save_at: int | None = None, load: bool = False) -> None:
    """Log ``loss`` = 1/(step+1) at ``steps``, saving a checkpoint after ``save_at``."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with="dvclive", project_config=config)
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.prepare(torch.nn.Linear(2, 2))
    if load:
        accelerator.load_state()
    for step in steps:
        accelerator.log({"loss": 1.0 / (step + 1), "train/acc": step / 10}, step=step)
        if step == save_at:
            accelerator.save_state()
    accelerator.end_training()


def test_a_resumed_job_continues_the_folder_with_each_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "p"
    _job(project, range(0, 6), save_at=2)  # "crashes" after step 5; the checkpoint has step 2
    _job(project, range(3, 8), load=True)
    folder = project / "run" / "dvclive"
    metrics = dvclive_metrics(str(folder))
    assert metrics["loss"] == [(s, 1.0 / (s + 1)) for s in range(8)]
    assert metrics["train/acc"] == [(s, s / 10) for s in range(8)]
    latest = json.loads((folder / "metrics.json").read_text())
    assert latest["step"] == 7 and latest["loss"] == 1.0 / 8
    assert "lr: 0.1" in (folder / "params.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # nothing in the working dir


def test_a_reference_to_another_folder_is_not_followed(tmp_path: Path) -> None:
    other = tmp_path / "other" / "dvclive" / "plots" / "metrics"
    other.mkdir(parents=True)
    (other / "loss.tsv").write_text("step\tloss\n0\t1.0\n5\t2.0\n")
    tracker = DVCLiveTracker("run", logging_dir=str(tmp_path / "p"))
    with pytest.warns(UserWarning, match="continuing in this job's folder"):
        tracker.continue_run({"dir": str(other.parent.parent)}, 0)
    tracker.start()
    tracker.log({"loss": 3.0}, step=1)
    tracker.finish()
    assert (other / "loss.tsv").read_text() == "step\tloss\n0\t1.0\n5\t2.0\n"  # untouched
    assert dvclive_metrics(tracker.dir)["loss"] == [(1, 3.0)]


def test_a_link_in_the_folder_stops_the_resume_and_its_target_is_untouched(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "p" / "run" / "dvclive"
    metrics = folder / "plots" / "metrics"
    metrics.mkdir(parents=True)
    target = tmp_path / "precious.tsv"
    target.write_text("step\tloss\n0\t1.0\n9\t2.0\n")
    (metrics / "loss.tsv").symlink_to(target)
    tracker = DVCLiveTracker("run", logging_dir=str(tmp_path / "p"))
    tracker.continue_run(None, 0)
    with pytest.raises(TrackerFileError, match=r"loss\.tsv. is a symbolic link"):
        tracker.start()
    assert target.read_text() == "step\tloss\n0\t1.0\n9\t2.0\n"


def test_names_that_would_leave_the_folder_stay_inside(tmp_path: Path) -> None:
    tracker = DVCLiveTracker("run", logging_dir=str(tmp_path / "p"))
    tracker.start()
    tracker.log({"../../escaped": 1.0, "/abs": 2.0, "a//b": 3.0}, step=0)
    tracker.log_images({"../img": np.zeros((4, 4, 3), dtype=np.uint8)}, step=0)
    tracker.finish()
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert all(name.startswith("p/run/dvclive/") for name in written), written
    assert set(dvclive_metrics(tracker.dir)) == {"_/_/escaped", "_/abs", "a/_/b"}


def test_images_are_kept_per_step(tmp_path: Path) -> None:
    from PIL import Image

    accelerator = Accelerator(log_with="dvclive", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    red = np.zeros((8, 6, 3), dtype=np.float32)
    red[..., 0] = 1.0  # HWC floats in 0-1
    chw = torch.zeros(3, 8, 6)
    chw[2] = 1.0  # a CHW tensor: blue
    accelerator.get_tracker("dvclive").log_images({"sample": red}, step=3)
    accelerator.get_tracker("dvclive").log_images({"sample": [chw, red]}, step=4)
    accelerator.end_training()
    images = tmp_path / "run" / "dvclive" / "plots" / "images" / "sample"
    assert sorted(p.name for p in images.iterdir()) == ["3.png", "4_0.png", "4_1.png"]
    assert np.asarray(Image.open(images / "3.png"))[0, 0].tolist() == [255, 0, 0]
    assert np.asarray(Image.open(images / "4_0.png"))[0, 0].tolist() == [0, 0, 255]


def test_journal_delivered_reads_the_metric_files(tmp_path: Path) -> None:
    tracker = DVCLiveTracker("run", logging_dir=str(tmp_path))
    tracker.start()
    tracker.log({"loss": 0.5, "acc": 0.25}, step=3)
    assert tracker.journal_delivered(3, {"loss": 0.5, "acc": 0.25, "note": "text"})
    assert not tracker.journal_delivered(3, {"loss": 0.75})  # another value at that step
    assert not tracker.journal_delivered(4, {"loss": 0.5})  # nothing at that step
    assert not tracker.journal_delivered(3, {"other": 1.0})  # never logged
    tracker.finish()


def test_accelerates_idioms_dir_in_init_kwargs_and_a_live_of_ones_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dvclive import Live

    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(log_with="dvclive")  # no logging dir, as Accelerate's example
    accelerator.init_trackers("p", init_kwargs={"dvclive": {"dir": str(tmp_path / "mine")}})
    accelerator.log({"loss": 1.0}, step=0)
    assert isinstance(accelerator.get_tracker("dvclive", unwrap=True), Live)
    accelerator.end_training()
    assert dvclive_metrics(str(tmp_path / "mine"))["loss"] == [(0, 1.0)]

    live = Live(str(tmp_path / "own"), dvcyaml=False, save_dvc_exp=False)
    accelerator = Accelerator(log_with=[DVCLiveTracker(live=live)])
    accelerator.init_trackers("p")
    accelerator.log({"loss": 2.0}, step=5)
    assert accelerator.get_tracker("dvclive", unwrap=True) is live
    accelerator.end_training()
    assert dvclive_metrics(str(tmp_path / "own"))["loss"] == [(5, 2.0)]


def test_text_is_skipped_with_one_warning(tmp_path: Path) -> None:
    tracker = DVCLiveTracker("run", logging_dir=str(tmp_path))
    tracker.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            tracker.log({"loss": 1.0, "note": "text"}, step=step)
    tracker.finish()
    about = [str(w.message) for w in caught if "'note'" in str(w.message)]
    assert len(about) == 1 and "DVCLive" in about[0]
    assert set(dvclive_metrics(tracker.dir)) == {"loss"}


def _dvc_env() -> dict[str, Any]:
    return {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_STUDIO_OFFLINE": "true"}


def test_inside_a_dvc_repository_dvclives_own_defaults_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real DVC repository (no git): DVCLive's dvc.yaml goes to the repository's root, where
    # DVC reads it, not into the run's folder.
    subprocess.run(
        [sys.executable, "-m", "dvc", "init", "--no-scm", "-q"],
        cwd=tmp_path,
        env=_dvc_env(),
        check=True,
        timeout=120,
    )
    monkeypatch.chdir(tmp_path)
    tracker = DVCLiveTracker("run", logging_dir=str(tmp_path / "p"), save_dvc_exp=False)
    tracker.start()
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert (tmp_path / "dvc.yaml").is_file()
    assert not (tmp_path / "p" / "run" / "dvclive" / "dvc.yaml").exists()
    assert "p/run/dvclive/plots/metrics" in (tmp_path / "dvc.yaml").read_text()


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60
    ).stdout


def test_inside_a_git_repository_the_repository_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DVCLive by itself runs `dvc init` at the Git root and stashes the working tree at the
    # end to commit an experiment; the tracker keeps to its folder.
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "train.py").write_text("print('hi')\n")
    _git(repo, "add", "train.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    (repo / "train.py").write_text("print('edited, not committed')\n")
    monkeypatch.chdir(repo)
    _job(repo / "runs", range(3), save_at=1)
    _job(repo / "runs", range(2, 4), load=True)
    assert sorted(p.name for p in repo.iterdir()) == [".git", "runs", "train.py"]
    assert (repo / "train.py").read_text() == "print('edited, not committed')\n"
    assert _git(repo, "status", "--porcelain") == " M train.py\n?? runs/\n"
    assert _git(repo, "for-each-ref").count("\n") == 1  # the branch only: no refs/exps
    assert _git(repo, "stash", "list") == ""
    assert dvclive_metrics(str(repo / "runs" / "run" / "dvclive"))["loss"] == [
        (s, 1.0 / (s + 1)) for s in range(4)
    ]


def test_sync_of_a_crafted_journal_writes_only_under_the_logging_dir(tmp_path: Path) -> None:
    from accelkit.cli.main import main
    from accelkit.trackers.delivery.journal import Journal

    project = tmp_path / "project"
    journal = Journal.open(str(project), "dvclive")
    journal.write_run({"tracker": "dvclive", "project_name": "../../outside", "reference": None})
    journal.write([journal.entry("log", 0, {"loss": 1.0})])
    journal.close()
    assert main(["track", "sync", str(project)]) == 0
    written = [p for p in tmp_path.rglob("*.tsv")]
    assert [str(p.relative_to(project)) for p in written] == [
        "_/_/outside/dvclive/plots/metrics/loss.tsv"
    ]
