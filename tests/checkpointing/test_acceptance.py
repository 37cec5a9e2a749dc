"""Acceptance: interrupted training resumes bit-identically, with rotation, locally and on S3.

Each run is a fresh process (through ``run_distributed``), so nothing survives in memory
between the interrupted run and its resumption.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.distributed import run_distributed

EPOCHS = 5


class _Counter:
    """A registered object: counts epochs and optimizer steps."""

    def __init__(self) -> None:
        self.epochs = 0
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.epochs, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epochs, self.steps = state["epochs"], state["steps"]


def _train(project: str, options: dict[str, Any], stop_after: int, resume: bool) -> dict[str, Any]:
    import random

    import numpy as np
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.checkpointing.catalog.listing import committed_automatic, list_checkpoints
    from accelkit.checkpointing.storage import get_storage, join

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=True,
        total_limit=2,
        storage_options=options,
    )
    accelerator = Accelerator(project_config=config)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(64, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    loaded = accelerator.load_state() if resume else None
    saved = []
    for _ in range(counter.epochs, stop_after):
        model.train()
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.steps += 1
        counter.epochs += 1
        saved.append(accelerator.save_state().rstrip("/").rsplit("/", 1)[-1])
    root = join(project, "checkpoints")
    remaining = [
        i.name for i in committed_automatic(list_checkpoints(get_storage(root, options), root))
    ]
    unwrapped = accelerator.unwrap_model(model)
    return {
        "params": {k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items()},
        "loaded": None if loaded is None else loaded.rstrip("/").rsplit("/", 1)[-1],
        "saved": saved,
        "remaining": remaining,
        "counter": (counter.epochs, counter.steps),
        "lr": scheduler.get_last_lr(),
    }


def _train_first(full: str, split: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """The uninterrupted run, then the run that stops after 3 epochs."""
    return _train(full, options, EPOCHS, False), _train(split, options, 3, False)


def _check_resume(make_project: Any, options: dict[str, Any], world_size: int) -> None:
    full_dir, split_dir = make_project("full"), make_project("split")
    if world_size == 1:  # only the resumption needs a fresh process
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in run_distributed's workers: same arithmetic
        try:
            full, first = _train_first(full_dir, split_dir, options)
        finally:
            torch.set_num_threads(threads)
    else:
        (full, first), *_ = run_distributed(
            _train_first, full_dir, split_dir, options, world_size=world_size
        )
    assert full["saved"] == [f"checkpoint_{i}" for i in range(EPOCHS)]
    assert full["remaining"] == ["checkpoint_3", "checkpoint_4"]
    assert first["remaining"] == ["checkpoint_1", "checkpoint_2"]

    results = run_distributed(_train, split_dir, options, EPOCHS, True, world_size=world_size)
    second = results[0]
    assert second["loaded"] == "checkpoint_2"
    assert second["saved"] == ["checkpoint_3", "checkpoint_4"]  # numbering continues
    assert second["remaining"] == ["checkpoint_3", "checkpoint_4"]
    assert second["counter"] == full["counter"]
    assert second["lr"] == full["lr"]
    assert second["params"].keys() == full["params"].keys()
    for name, value in full["params"].items():
        assert torch.equal(second["params"][name], value), name
    for other in results[1:]:  # every process ends with the same parameters
        for name, value in second["params"].items():
            assert torch.equal(other["params"][name], value), name


def test_resume_bit_identical_local(tmp_path: Any) -> None:
    _check_resume(lambda name: str(tmp_path / name), {}, world_size=1)


def test_resume_bit_identical_s3(s3_server: Any) -> None:
    prefix = s3_server.new_prefix()
    _check_resume(lambda name: f"{prefix}/{name}", s3_server.storage_options, world_size=1)


def test_resume_bit_identical_two_processes(tmp_path: Any) -> None:
    _check_resume(lambda name: str(tmp_path / name), {}, world_size=2)
