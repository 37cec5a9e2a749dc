"""A script written for Accelerate that measures how exactly a mid-epoch resume continues an
uninterrupted run (run under Accelerate and, imports renamed, under accelkit, by hand; the
figures are in docs/guides/porting-notes.md).

Usage: resume_exactness.py OUT.json FOLDER [--stateful]

It trains 2 epochs of 8 shuffled batches (a model with dropout) uninterrupted; then trains
again, saves after batch 4 of epoch 0 and stops; then resumes from that checkpoint the way the
Accelerate documents show (``skip_first_batches`` for the resumed epoch; with ``--stateful``,
a ``StatefulDataLoader`` iterated as it is) and records the batches and losses of the rest.
"""

import json
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

DONE = 4  # batches of epoch 0 done when the checkpoint is saved


def build(stateful):
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)
    )
    set_seed(0)
    x = torch.linspace(-1, 1, 64).reshape(32, 2)
    data = TensorDataset(torch.arange(32), x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def train_step(accelerator, model, optimizer, batch, out):
    ids, inputs, targets = batch
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    out.append([ids.tolist(), round(loss.item(), 6)])


def main(out_path, folder, stateful):
    accelerator, model, optimizer, loader = build(stateful)
    full = []
    for _ in range(2):
        for batch in loader:
            train_step(accelerator, model, optimizer, batch, full)

    accelerator, model, optimizer, loader = build(stateful)
    for i, batch in enumerate(loader):
        train_step(accelerator, model, optimizer, batch, [])
        if i + 1 == DONE:
            accelerator.save_state(folder)
            break

    accelerator, model, optimizer, loader = build(stateful)
    accelerator.load_state(folder)
    resumed = []
    for epoch in range(2):
        active = loader
        if epoch == 0 and not stateful:
            active = accelerator.skip_first_batches(loader, DONE)
        for batch in active:
            train_step(accelerator, model, optimizer, batch, resumed)
    want = full[DONE:]
    same_steps = 0
    for got, expected in zip(resumed, want):
        if got != expected:
            break
        same_steps += 1
    row = {
        "steps_after_resume": len(resumed),
        "steps_expected": len(want),
        "identical_steps_from_resume": same_steps,
        "same_batches": sum(g[0] == w[0] for g, w in zip(resumed, want)),
        "same_losses": sum(g[1] == w[1] for g, w in zip(resumed, want)),
    }
    with open(out_path, "w") as f:
        json.dump(row, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--stateful" in sys.argv[3:])
