"""Runs with checkpoints in every state, made by the real ``Accelerator.save_state``."""

from __future__ import annotations

from typing import Any

import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.formats.layout import MANIFEST_NAME
from accelkit.checkpointing.storage import get_storage, join

__all__ = ["build_run", "model_state", "save_on_two_ranks"]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def model_state() -> dict[str, torch.Tensor]:
    """The state dict of the model the checkpoints hold (names and shapes)."""
    return _model().state_dict()


def build_run(project_dir: str, storage_options: dict[str, Any] | None = None) -> None:
    """Train a tiny model with AdamW and ``save_state`` six times under ``project_dir``.

    Leaves, oldest first: committed ``checkpoint_0``, ``checkpoint_1``; ``checkpoint_2``
    incomplete (its manifest removed: a crashed save); committed ``checkpoint_3``,
    ``checkpoint_4``; ``checkpoint_5`` incomplete (a save in flight); and a stray
    ``checkpoints/best`` folder that is not a checkpoint. Metric ``loss`` is ``1/(i+1)``,
    except ``checkpoint_0`` which has the best, 0.01.
    """
    config = ProjectConfiguration(
        project_dir=project_dir,
        automatic_checkpoint_naming=True,
        storage_options=dict(storage_options or {}),
    )
    accelerator = Accelerator(project_config=config)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    storage = get_storage(project_dir, storage_options)
    for i in range(6):
        accelerator.backward(model(torch.randn(3, 4)).square().sum())
        optimizer.step()
        optimizer.zero_grad()
        path = accelerator.save_state(metrics={"loss": 0.01 if i == 0 else 1.0 / (i + 1)})
        assert path == join(project_dir, "checkpoints", f"checkpoint_{i}"), path
        if i in (2, 5):
            storage.remove(join(path, MANIFEST_NAME))
    storage.write_bytes(join(project_dir, "checkpoints", "best", "notes.txt"), b"my best run")


def save_on_two_ranks(project_dir: str) -> str:
    """Run in each of 2 processes (``run_distributed``): one step, one ``save_state``."""
    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config)
    model, optimizer = accelerator.prepare(_model(), torch.optim.AdamW(_model().parameters()))
    accelerator.backward(model(torch.randn(3, 4)).square().sum())
    optimizer.step()
    return accelerator.save_state(metrics={"loss": 0.5})
