"""Checkpoints on S3, or any S3-compatible store (MinIO, SeaweedFS, Ceph, R2, ...).

    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...
    export AWS_ENDPOINT_URL=http://127.0.0.1:8333   # only for a store other than AWS itself
    accelkit launch --cpu --num_processes 2 examples/s3_checkpoints.py \\
        --project_dir s3://my-bucket/runs/demo

``project_dir`` is an ``s3://`` URL: checkpoints go to ``<project_dir>/checkpoints/checkpoint_<n>``
with the same commit protocol as on a local disk (the manifest ``accelkit.json`` is written last,
in one PUT, and only committed checkpoints count), ``total_limit`` rotation runs after each
commit, and run again the script resumes from the newest committed checkpoint. The endpoint and
credentials come from the usual ``AWS_*`` variables and are passed to s3fs as
``ProjectConfiguration(storage_options=...)``. Trackers write local files, so the logs go to
``--logging_dir``.

List and check the checkpoints without Python:

    accelkit ckpt ls s3://my-bucket/runs/demo -o endpoint_url=$AWS_ENDPOINT_URL
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import fsspec
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelkit import Accelerator, ProjectConfiguration, set_seed


def storage_options_from_env() -> dict[str, Any]:
    """s3fs options from ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``."""
    options: dict[str, Any] = {}
    if os.environ.get("AWS_ENDPOINT_URL"):
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        options["secret"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def has_checkpoint(project_dir: str, options: dict[str, Any]) -> bool:
    """Whether a committed checkpoint (one whose manifest exists) is under ``project_dir``."""
    fs, root = fsspec.core.url_to_fs(project_dir, **options)
    return bool(fs.glob(f"{root}/checkpoints/checkpoint_*/accelkit.json"))


class Progress:
    """The epoch reached; saved in every checkpoint by ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


def main(args: argparse.Namespace) -> None:
    options = storage_options_from_env()
    accelerator = Accelerator(
        log_with="jsonl",
        project_config=ProjectConfiguration(
            project_dir=args.project_dir,
            logging_dir=args.logging_dir,
            automatic_checkpoint_naming=True,
            total_limit=args.keep,
            storage_options=options,
        ),
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).tanh()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    if has_checkpoint(args.project_dir, options):
        path = accelerator.load_state()
        accelerator.print(f"resumed from {path} (epoch {progress.epoch})")

    accelerator.init_trackers("s3_checkpoints")
    for epoch in range(progress.epoch, args.epochs):
        for inputs, targets in loader:
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        progress.epoch = epoch + 1
        loss_value = accelerator.reduce(loss.detach(), reduction="mean").item()
        accelerator.log({"loss": loss_value}, step=progress.epoch)
        path = accelerator.save_state(metrics={"loss": loss_value})
        accelerator.print(f"epoch {progress.epoch}: loss {loss_value:.4f}, saved {path}")

    # Final weights, loadable with accelkit.load_checkpoint_in_model or safetensors.
    accelerator.wait_for_everyone()
    accelerator.save_model(model, f"{args.project_dir}/model")
    accelerator.print(f"model saved to {args.project_dir}/model")
    accelerator.end_training()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--project_dir", required=True, help="s3://bucket/prefix of the run")
    parser.add_argument("--logging_dir", default="runs/s3_checkpoints", help="local log folder")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep (total_limit)")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
