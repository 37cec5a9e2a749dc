"""load_state(path) says what the path is and what to pass instead (issue 16, item 6).

Each case is a real project with committed checkpoints; the path given is what a user gets
wrong: a typo, the project folder, its ``checkpoints`` folder, a file, an interrupted save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError


def _accelerator(project: Path) -> tuple[Accelerator, nn.Module]:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(3, 2))
    return accelerator, model


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    accelerator, _ = _accelerator(root)
    accelerator.save_state()
    accelerator.save_state()
    return root


def _error(project: Path, path: Path | str) -> CheckpointError:
    accelerator, model = _accelerator(project)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(str(path))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing restored
    return info.value


def test_a_typo_names_the_close_folders(project: Path) -> None:
    error = _error(project, project / "checkpoints" / "checkpoint_l")
    message = str(error)
    assert "does not exist" in message
    assert "Did you mean" in message and "checkpoint_1" in message, message
    assert "did not finish" not in message


def test_the_project_folder_points_at_load_state_and_its_checkpoints(project: Path) -> None:
    message = str(_error(project, project))
    assert "project folder with 2 committed checkpoint(s)" in message, message
    assert "load_state()" in message and "checkpoint_1" in message, message


def test_the_checkpoints_folder_is_named_as_such(project: Path) -> None:
    message = str(_error(project, project / "checkpoints"))
    assert "folder of checkpoints with 2 committed" in message, message


def test_a_file_is_not_a_checkpoint_folder(project: Path) -> None:
    path = project / "checkpoints" / "checkpoint_1" / "model.safetensors"
    error = _error(project, path)
    assert not isinstance(error, CorruptCheckpointError)
    assert "is a file, not a checkpoint folder" in str(error), error
    assert "load_checkpoint_in_model" in str(error)


def test_an_interrupted_save_is_called_one(project: Path) -> None:
    folder = project / "checkpoints" / "checkpoint_1"
    (folder / "accelkit.json").unlink()  # the marker stays: an accelkit save that did not finish
    message = str(_error(project, folder))
    assert "accelkit save that did not finish" in message, message


def test_a_folder_written_by_somebody_else_is_not_called_an_interrupted_save(
    project: Path,
) -> None:
    folder = project / "checkpoints" / "checkpoint_7"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    message = str(_error(project, folder))
    assert "foreign folder, not an accelkit checkpoint" in message, message
    assert "did not finish" not in message
    assert (folder / "notes.txt").read_text() == "mine"


class _Grown(nn.Module):
    """The saved model plus a head the checkpoint does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.head = nn.Linear(2, 1)


def test_load_state_forwards_strict_to_the_models_as_accelerate_does(tmp_path: Path) -> None:
    saver = Accelerator(cpu=True)
    torch.manual_seed(0)
    saved = nn.Module()
    saved.layer = nn.Linear(3, 2)
    saved = saver.prepare(saved)
    saver.save_state(str(tmp_path / "ckpt"))

    loader = Accelerator(cpu=True)
    torch.manual_seed(1)
    grown = loader.prepare(_Grown())
    head = grown.head.weight.detach().clone()
    with pytest.raises(CheckpointError, match="missing keys"):
        loader.load_state(str(tmp_path / "ckpt"))  # strict by default, as torch's
    assert not torch.equal(grown.layer.weight, saved.layer.weight)  # nothing restored
    with pytest.raises(TypeError, match=r"\['stric'\]"):
        loader.load_state(str(tmp_path / "ckpt"), stric=False)
    loader.load_state(str(tmp_path / "ckpt"), strict=False)
    assert torch.equal(grown.layer.weight, saved.layer.weight)
    assert torch.equal(grown.head.weight, head)  # the key the checkpoint lacks is kept
