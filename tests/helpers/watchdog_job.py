"""A training job for the watchdog tests, run under ``accelkit launch`` with 2 processes:
``python tests/helpers/watchdog_job.py PROJECT MODE [--timeout T] [--steps N]``.

Modes:

* ``collective``: at step 3 rank 1 stops in a sleep that never ends, so rank 0 hangs in the
  gradient all-reduce of its backward;
* ``loader``: rank 1's dataset never returns its fourth item, so rank 1 hangs in the data
  loader and rank 0 in its collective;
* ``jitter``: a slow but moving job, every step from 0 to 2/3 of the timeout, with an
  evaluation of twice the timeout inside ``not_a_hang()``: it must finish (exit 0);
* ``straggler``: rank 1 sleeps ``--slow`` seconds in every step's forward (a slow rank);
* ``even``: every rank jitters at random, on its own, from 0 to 0.1 s a step: no straggler.

The trackers log to ``PROJECT`` with the built-in ``jsonl`` tracker. Self-contained: it imports
only accelkit and torch.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from accelkit import Accelerator

# Set on rank 1 in ``loader`` mode: from then on the dataset never returns an item.
HANG = {"loader": False}


class _Data(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        while HANG["loader"]:  # a loader that never yields
            time.sleep(3600)
        g = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("mode")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow", type=float, default=0.2)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=20)
    args = parser.parse_args()
    kwargs = {}
    if args.mode in ("straggler", "even"):
        kwargs = {"straggler_fraction": args.fraction, "straggler_steps": args.window}
    accelerator = Accelerator(
        project_dir=args.project,
        log_with="jsonl",
        hang_timeout_seconds=args.timeout,
        **kwargs,  # type: ignore[arg-type]
    )
    accelerator.init_trackers("watchdog")
    rank = accelerator.process_index
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_Data(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    jitter = random.Random(rank)  # each rank's own jitter
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        if args.mode == "collective" and rank == 1 and step == 3:
            while True:
                time.sleep(3600)
        if args.mode == "loader" and rank == 1 and step == 3:
            HANG["loader"] = True
        if args.mode in ("jitter", "even"):
            time.sleep(jitter.uniform(0, args.timeout * 2 / 3 if args.mode == "jitter" else 0.1))
        if args.mode == "straggler" and rank == 1:
            time.sleep(args.slow)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.mode == "jitter" and step == 5:
            with accelerator.not_a_hang():  # a long evaluation
                time.sleep(args.timeout * 2)
        accelerator.log({"loss": float(loss.detach())}, step=step)
    accelerator.end_training()


if __name__ == "__main__":
    main()
