"""`accelkit ckpt ls` names each checkpoint's tracker runs: RUNS column, `experiment` in JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, GeneralTracker, ProjectConfiguration
from accelkit.cli.main import main

RUN_ID = "0123456789abcdef0123456789abcdef"


class IdTracker(GeneralTracker):
    """A tracker whose runs have an id (as MLflow's and W&B's)."""

    name = "ids"

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        pass

    def run_reference(self) -> dict[str, Any] | None:
        return {"run_id": RUN_ID, "project": "p"}


class FolderTracker(GeneralTracker):
    """A tracker whose run is a folder (as TensorBoard's)."""

    name = "folder"

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.log_dir = log_dir

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        pass

    def run_reference(self) -> dict[str, Any] | None:
        return {"log_dir": self.log_dir}


def _ls(capsys: pytest.CaptureFixture[str], project: Path, *flags: str) -> str:
    capsys.readouterr()
    assert main(["ckpt", "ls", str(project), *flags]) == 0
    return capsys.readouterr().out


def _table(text: str) -> dict[str, dict[str, str]]:
    """Rows by name (cells are separated by two spaces or more, never hold two)."""
    header, *lines = text.splitlines()
    names = header.split()
    rows = [dict(zip(names, re.split(r"\s{2,}", line.strip()), strict=True)) for line in lines]
    return {row["NAME"]: row for row in rows}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """checkpoint_0 and checkpoint_1 saved with two trackers (at steps 0 and 3),
    checkpoint_2 by a job without trackers, checkpoint_3 incomplete (no manifest)."""
    project = tmp_path / "project"
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(
        log_with=[IdTracker(), FolderTracker(str(tmp_path / "tb"))], project_config=config
    )
    accelerator.init_trackers("p")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.save_state()
    accelerator.log({"loss": 0.5}, step=3)
    accelerator.save_state()
    accelerator.end_training()
    config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, iteration=2
    )
    Accelerator(project_config=config).save_state()
    Accelerator(project_config=config).save_state()
    (project / "checkpoints" / "checkpoint_3" / "accelkit.json").unlink()
    return project


def test_ls_shows_the_runs_and_json_has_the_experiment_record(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = {item["name"]: item for item in json.loads(_ls(capsys, project, "--json"))}
    runs = {"ids": {"run_id": RUN_ID, "project": "p"}, "folder": {"log_dir": str(tmp_path / "tb")}}
    key = listed["checkpoint_0"]["experiment"]["key"]  # the run key: one per run
    first, second = listed["checkpoint_0"]["experiment"], listed["checkpoint_1"]["experiment"]
    assert first == {"step": 0, "saved_at_step": 0, "key": key, "runs": runs}
    assert second == {"step": 3, "saved_at_step": 3, "key": key, "runs": runs}
    assert listed["checkpoint_2"]["experiment"] == {}  # saved without trackers
    assert listed["checkpoint_3"]["experiment"] is None  # no manifest
    for name in ("checkpoint_0", "checkpoint_1", "checkpoint_2"):
        manifest = json.loads((project / "checkpoints" / name / "accelkit.json").read_text())
        assert listed[name]["experiment"] == manifest.get("experiment", {})

    rows = _table(_ls(capsys, project))
    assert rows["checkpoint_0"]["RUNS"] == rows["checkpoint_1"]["RUNS"] == "folder,ids:01234567"
    assert rows["checkpoint_2"]["RUNS"] == rows["checkpoint_3"]["RUNS"] == "-"


def test_a_crafted_reference_is_shown_as_one_plain_cell(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = project / "checkpoints" / "checkpoint_1" / "accelkit.json"
    manifest = json.loads(path.read_text())
    manifest["experiment"]["runs"] = {
        "evil\x1b[31m": {"run_id": "\x1b]0;title\x07 rm -rf"},
        "comet_ml": {"experiment_key": 5},  # not text: the name alone
        "wandb": {"run_id": "abc12345"},
    }
    path.write_text(json.dumps(manifest))
    out = _ls(capsys, project)
    assert "\x1b" not in out and "\x07" not in out
    # Escaped as every name the CLI prints (no raw control byte), one entry per tracker.
    runs = _table(out)["checkpoint_1"]["RUNS"]
    assert runs == "comet_ml,evil\\x1b[31m:\\x1b]0;titl,wandb:abc12345"
    listed = {item["name"]: item for item in json.loads(_ls(capsys, project, "--json"))}
    assert listed["checkpoint_1"]["experiment"]["runs"]["wandb"] == {"run_id": "abc12345"}
