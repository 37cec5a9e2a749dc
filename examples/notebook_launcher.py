"""Multi-process training from a notebook (or any Python session) with ``notebook_launcher``.

In a Jupyter cell, define the training function and call ``notebook_launcher`` with it; here
the same code runs as a script:

    python examples/notebook_launcher.py

Keep everything that touches CUDA inside the launched function: the workers are forked from
the notebook's process, and a CUDA context created before the fork cannot be used by them.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelkit import Accelerator, notebook_launcher


def training_loop(epochs: int, batch_size: int) -> None:
    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(500, 4, generator=generator)
    y = (x[:, :1] > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(epochs):
        correct = total = 0
        for inputs, targets in loader:
            logits = model(inputs)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            predictions, labels = accelerator.gather_for_metrics(((logits > 0).float(), targets))
            correct += int((predictions == labels).sum())
            total += len(labels)
        accelerator.print(
            f"epoch {epoch + 1}: accuracy {correct / total:.3f} over {total} samples "
            f"on {accelerator.num_processes} processes"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    # In a notebook: notebook_launcher(training_loop, (3, 32), num_processes=2, cpu=True)
    notebook_launcher(
        training_loop, (args.epochs, args.batch_size), num_processes=args.num_processes, cpu=True
    )
