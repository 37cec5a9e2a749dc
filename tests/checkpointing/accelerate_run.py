"""One training run for the Accelerate-import tests, started by ``torch.distributed.run``.

``python -m torch.distributed.run --nproc_per_node N accelerate_run.py MODE OUT PRECISION
FOLDER...`` (one process: plain ``python accelerate_run.py ...``)

- ``MODE=accelerate``: train with Hugging Face accelerate's ``Accelerator`` for ``SAVE_AT``
  steps, ``save_state(FOLDER)``, train ``AFTER`` more steps; write each step's loss.
- ``MODE=accelkit``: build the same objects with accelkit's ``Accelerator``, ``load_state
  (FOLDER)`` (an Accelerate folder, or what ``accelkit ckpt import`` made of it), train
  ``AFTER`` steps; write each step's loss. With several folders, one fresh run per folder.

Every step draws from Python's, NumPy's and torch's global generators (input noise) and from
dropout, so a continuation matches only if every process's generator states came back; AdamW
and a LambdaLR warm-up make the optimizer moments, step counts and schedule matter; a
registered counter must come back too. ``OUT/losses_<rank>.json`` holds the losses (and the
counter) of this process after the save.
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAVE_AT = 3
AFTER = 3


class Counter:
    """A registered object: how many batches were seen."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    return model, optimizer, scheduler


def batch(step: int, rank: int, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fixed = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=fixed) + 0.01 * extra.sum()
    y = x.sum(dim=1, keepdim=True)
    # Noise from the three global generators: each must be restored for the same losses.
    scale = random.random() * float(np.random.rand())
    return x + scale * torch.randn(8, 6), y


def train_step(accelerator, model, optimizer, scheduler, counter, step, extra) -> float:  # type: ignore[no-untyped-def]
    x, y = batch(step, accelerator.process_index, extra)
    with accelerator.autocast():
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    counter.seen += 1
    return float(loss.detach())


def run(mode: str, folder: str, precision: str) -> tuple[int, dict[str, object]]:
    if mode == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
    else:
        from accelkit import Accelerator, set_seed  # type: ignore[no-redef]
        from accelkit.utils import DataLoaderConfiguration  # type: ignore[no-redef]
    accelerator = Accelerator(
        cpu=True,
        mixed_precision=precision,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    set_seed(1234 + accelerator.process_index)
    model, optimizer, scheduler = build()
    # Not shuffled: Accelerate saves the position in the epoch, not the epoch's permutation.
    loader = DataLoader(TensorDataset(torch.arange(96.0).view(48, 2)), batch_size=2)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model.train()
    losses, batches = [], []
    if mode == "accelerate":
        for step, (extra,) in enumerate(loader):
            if step >= SAVE_AT + AFTER:
                break
            loss = train_step(accelerator, model, optimizer, scheduler, counter, step, extra)
            if step == SAVE_AT - 1:
                accelerator.save_state(folder)
            elif step >= SAVE_AT:
                losses.append(loss)
                batches.append(extra.tolist())
    else:
        # Scramble every generator: only a restore brings the continuation back.
        set_seed(99)
        accelerator.load_state(folder)
        for step, (extra,) in enumerate(loader, start=SAVE_AT):
            if step >= SAVE_AT + AFTER:
                break
            losses.append(
                train_step(accelerator, model, optimizer, scheduler, counter, step, extra)
            )
            batches.append(extra.tolist())
    accelerator.wait_for_everyone()
    return accelerator.process_index, {
        "losses": losses,
        "batches": batches,
        "seen": counter.seen,
        "lr": scheduler.get_last_lr(),
    }


def main() -> None:
    mode, out, precision, *folders = sys.argv[1:]
    results = {}
    rank = 0
    for folder in folders:  # accelkit mode: one fresh Accelerator per folder
        rank, results[folder] = run(mode, folder, precision)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"losses_{rank}.json"), "w") as f:
        json.dump(results, f)
    if torch.distributed.is_initialized():  # leave together: no peer sees a closed socket
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
