"""Train a small MLP on synthetic data with accelkit: the README's main job.

    accelkit launch --cpu --num_processes 2 examples/quickstart.py

It logs to ``jsonl`` and TensorBoard, saves a checkpoint after every epoch (keeping the newest
``--keep``), and, run again, resumes from the newest committed checkpoint:

    accelkit launch --cpu --num_processes 2 examples/quickstart.py --epochs 5

Everything goes under ``--project_dir`` (default ``runs/quickstart``): checkpoints in
``checkpoints/checkpoint_<n>``, logs in ``quickstart/`` (``metrics.jsonl`` + TensorBoard events).
Look at the checkpoints with ``accelkit ckpt ls runs/quickstart``.
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from accelkit import Accelerator, ProjectConfiguration, set_seed


class Progress:
    """How far training got; saved in every checkpoint by ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.epoch = 0
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def synthetic_regression(samples: int, features: int = 16) -> TensorDataset:
    """A smooth non-linear target plus noise, the same on every process (fixed seed)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    z = x @ w / features**0.5
    y = torch.sin(2 * z) + 0.5 * z + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def has_checkpoint(project_dir: str) -> bool:
    """Whether an earlier run committed a checkpoint: its manifest ``accelkit.json`` exists.

    The manifest is written last, so a folder without one (a save cut short) does not count;
    ``load_state()`` then picks the newest committed checkpoint.
    """
    pattern = os.path.join(project_dir, "checkpoints", "checkpoint_*", "accelkit.json")
    return bool(glob.glob(pattern))


def main(args: argparse.Namespace) -> None:
    accelerator = Accelerator(
        log_with=["jsonl", "tensorboard"],
        project_config=ProjectConfiguration(
            project_dir=args.project_dir,
            automatic_checkpoint_naming=True,  # checkpoints/checkpoint_0, checkpoint_1, ...
            total_limit=args.keep,  # older ones are deleted only after a new one is committed
        ),
    )
    set_seed(args.seed)

    loader = DataLoader(
        synthetic_regression(args.samples), batch_size=args.batch_size, shuffle=True
    )
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if has_checkpoint(args.project_dir):
        path = accelerator.load_state()  # the newest *committed* checkpoint
        accelerator.print(f"resumed from {path} (epoch {progress.epoch}, step {progress.step})")

    accelerator.init_trackers("quickstart", config=vars(args))
    for epoch in range(progress.epoch, args.epochs):
        model.train()
        total = torch.zeros((), device=accelerator.device)
        bar = tqdm(
            loader,
            desc=f"epoch {epoch + 1}/{args.epochs}",
            disable=not accelerator.is_local_main_process,
        )
        for x, y in bar:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            total += loss.detach()
            # Cheap: values are handed to a background thread; other processes return at once.
            accelerator.log({"train/loss": loss.detach()}, step=progress.step)
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        progress.epoch = epoch + 1
        epoch_loss = accelerator.reduce(total / len(loader), reduction="mean").item()
        accelerator.log({"epoch/loss": epoch_loss}, step=progress.step)
        path = accelerator.save_state(metrics={"loss": epoch_loss})  # shown by `accelkit ckpt ls`
        accelerator.print(f"epoch {epoch + 1}: mean loss {epoch_loss:.4f}, saved {path}")

    accelerator.print(
        f"done: {progress.epoch} epochs, {progress.step} steps; pass --epochs N to train on"
    )
    accelerator.end_training()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--epochs", type=int, default=3, help="total epochs (a resumed run trains the rest)"
    )
    parser.add_argument(
        "--project_dir", default="runs/quickstart", help="checkpoints and logs go here"
    )
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep (total_limit)")
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic dataset")
    parser.add_argument("--batch_size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
