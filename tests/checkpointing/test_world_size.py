"""A DDP checkpoint loads on another process count: same weights, deterministic random states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _save_on_one(project: str) -> list[float]:
    from accelkit import Accelerator, ProjectConfiguration, set_seed

    set_seed(7)
    acc = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True)
    )
    model = acc.prepare(torch.nn.Linear(3, 2))
    acc.save_state()
    return [float(x) for x in model.weight.detach().flatten()]


def _load_on_two(project: str) -> dict[str, Any]:
    from accelkit import Accelerator, ProjectConfiguration, set_seed

    set_seed(100)  # different init and RNG: the load must replace both
    acc = Accelerator(
        project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True)
    )
    model = acc.prepare(torch.nn.Linear(3, 2))
    acc.load_state()
    return {
        "weight": [float(x) for x in acc.unwrap_model(model).weight.detach().flatten()],
        "draw": torch.rand(3).tolist(),
    }


@pytest.mark.slow
def test_checkpoint_of_one_process_loads_on_two(tmp_path: Path) -> None:
    project = str(tmp_path / "run")
    saved = _save_on_one(project)
    after_save = torch.rand(3).tolist()  # what process 0 draws next in the saving run
    first = run_distributed(_load_on_two, project)
    again = run_distributed(_load_on_two, project)
    for rank in (0, 1):
        assert first[rank]["weight"] == saved  # weights come from the checkpoint everywhere
        assert first[rank]["draw"] == again[rank]["draw"]  # deterministic on every rank
    assert first[0]["draw"] == after_save  # rank 0 continues the saved stream exactly
    assert first[1]["draw"] != first[0]["draw"]  # rank 1 is seeded, not a copy of rank 0
