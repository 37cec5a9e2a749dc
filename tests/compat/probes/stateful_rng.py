"""A script written for Accelerate that trains with ``use_stateful_dataloader=True`` (as
``complete_nlp_example.py --use_stateful_dataloader`` does): a shuffled train loader and an eval
loader prepared together, a model with dropout. It records the first epoch's batches, every
loss, and the global RNG's next value; run by tests/compat/test_same_results.py under
Accelerate and, imports renamed, under accelkit.

Usage: stateful_rng.py OUT.json   (on every process of a launch, or alone)
"""

import json
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import gather_object, set_seed
from torch.utils.data import DataLoader, TensorDataset


def main(out_path):
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    set_seed(42)
    x = torch.linspace(-1, 1, 48).reshape(24, 2)
    data = TensorDataset(torch.arange(24), x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(data, batch_size=4, shuffle=True)
    evaluation = DataLoader(data, batch_size=8)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    row = {"ids": [], "losses": []}
    for _ in range(2):
        model.train()
        for ids, inputs, targets in train:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            row["ids"].append(ids.tolist())
            row["losses"].append(round(loss.item(), 6))
        model.eval()
        with torch.no_grad():
            for _, inputs, _targets in evaluation:
                row["losses"].append(round(model(inputs).sum().item(), 5))
    row["rng_after"] = torch.rand(2).tolist()
    rows = gather_object([row])
    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
