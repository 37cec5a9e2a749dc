"""Training that starts in a project holding checkpoints, without loading one, is warned about
once, before the first optimizer step, at the user's line, with the fix (issue #28 item 2).

Without the warning the run trains an epoch and dies in ``save_state`` (``checkpoint_0 already
exists``), or, when retention already removed ``checkpoint_0``, its new checkpoint is rotated
away at once as the oldest by number.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CheckpointPathError, UnresumedProjectWarning
from tests.helpers.distributed import run_distributed


def _run(project: Path, **config: Any) -> tuple[Accelerator, torch.nn.Module, Any]:
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            str(project), automatic_checkpoint_naming=True, **config
        ),
    )
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any) -> None:
    accelerator.backward(model(torch.ones(4, 2)).sum())  # the user's line
    optimizer.step()
    optimizer.zero_grad()


def _earlier_run(project: Path, saves: int, **config: Any) -> None:
    accelerator, model, optimizer = _run(project, **config)
    for _ in range(saves):
        _step(accelerator, model, optimizer)
        accelerator.save_state()
    accelerator.end_training()


def test_training_without_a_load_warns_once_at_the_first_backward(tmp_path: Path) -> None:
    _earlier_run(tmp_path, saves=2)
    accelerator, model, optimizer = _run(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(accelerator, model, optimizer)
        _step(accelerator, model, optimizer)
    found = [w for w in caught if issubclass(w.category, UnresumedProjectWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    message = str(found[0].message)
    root = str(tmp_path / "checkpoints")
    assert root in message and "checkpoint_0, checkpoint_1" in message
    assert "next automatic save is checkpoint_0, which exists already" in message
    assert "load_state()" in message and "new project_dir" in message
    assert "ProjectConfiguration(iteration=2)" in message
    # At the user's backward() line, not inside accelkit.
    assert found[0].filename == __file__
    # And the save it foretold fails with an error that names the fix too.
    with pytest.raises(CheckpointPathError, match=r"checkpoint_0 already exists.*load_state\(\)"):
        accelerator.save_state()


def test_no_warning_when_the_run_resumes_or_numbers_on(tmp_path: Path) -> None:
    _earlier_run(tmp_path, saves=2)
    for config in ({}, {"iteration": 3}):  # the resumed run saved checkpoint_2
        accelerator, model, optimizer = _run(tmp_path, **config)
        if not config:
            accelerator.load_state()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnresumedProjectWarning)
            _step(accelerator, model, optimizer)
            accelerator.save_state()
        accelerator.end_training()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"checkpoint_{i}" for i in range(4)]


def test_no_warning_in_a_fresh_project_or_without_automatic_naming(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnresumedProjectWarning)
        accelerator, model, optimizer = _run(tmp_path / "fresh")
        _step(accelerator, model, optimizer)
        accelerator.save_state()
        _earlier_run(tmp_path / "named", saves=1)
        accelerator = Accelerator(cpu=True, project_dir=str(tmp_path / "named"))
        model = accelerator.prepare(torch.nn.Linear(2, 1))
        accelerator.backward(model(torch.ones(1, 2)).sum())


def test_a_save_that_would_be_rotated_away_is_warned_at_save_state(tmp_path: Path) -> None:
    """checkpoint_0 was rotated away: the new checkpoint_0 would not collide but be the oldest
    by number, deleted by total_limit at once. A loop without accelerator.backward() is warned
    at its first save_state()."""
    _earlier_run(tmp_path, saves=3, total_limit=2)
    accelerator, _model, _ = _run(tmp_path, total_limit=2)
    with pytest.warns(
        UnresumedProjectWarning, match="total_limit deletes this run's checkpoints first"
    ) as caught:
        accelerator.save_state()
    assert caught[0].filename == __file__
    assert "ProjectConfiguration(iteration=3)" in str(caught[0].message)


def _worker(project: str) -> int:
    accelerator, model, optimizer = _run(Path(project))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(accelerator, model, optimizer)
    accelerator.end_training()
    return sum(issubclass(w.category, UnresumedProjectWarning) for w in caught)


@pytest.mark.slow
def test_two_processes_warn_once_on_the_main_process(tmp_path: Path) -> None:
    _earlier_run(tmp_path, saves=1)
    assert run_distributed(_worker, str(tmp_path)) == [1, 0]
