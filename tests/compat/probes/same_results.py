"""A script written for Accelerate that records what its helpers return (run by
tests/compat/test_same_results.py under Accelerate and, imports renamed, under accelkit).

Usage: same_results.py OUT.json   (on every process of a launch)
"""

import json
import sys

import torch
from accelerate import Accelerator, find_executable_batch_size
from accelerate.state import AcceleratorState
from accelerate.test_utils import RegressionDataset, RegressionModel
from accelerate.utils import (
    broadcast,
    convert_file_size_to_int,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    release_memory,
    set_seed,
    synchronize_rng_states,
)
from torch.utils.data import DataLoader


def main(out_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    state = AcceleratorState()
    rank, world = accelerator.process_index, accelerator.num_processes
    t = torch.arange(world, dtype=torch.float32) + 1 + world * rank
    row = {
        "distributed_type": str(state.distributed_type.value),
        "num_processes": state.num_processes,
        "mixed_precision": str(state.mixed_precision),
        "deepspeed_plugin": state.deepspeed_plugin,
        "reduce_default": reduce(t).tolist(),
        "reduce_sum": reduce(t, "sum").tolist(),
        "reduce_max": reduce(t, "max").tolist(),
        "reduce_scale": reduce(t, "sum", scale=0.5).tolist(),
        "accelerator_reduce_default": accelerator.reduce(t).tolist(),
        "gather": gather(t).tolist(),
        "gather_object": gather_object([{"rank": rank}]),
        "broadcast": broadcast(t.clone()).tolist(),
        "pad": pad_across_processes(torch.ones(rank + 1), pad_index=-1).tolist(),
        "pad_first": pad_across_processes(torch.ones(rank + 1), pad_first=True).tolist(),
        "file_size": [convert_file_size_to_int("10GB"), convert_file_size_to_int("1GiB")],
        "split_batches": accelerator.split_batches,
        "even_batches": accelerator.even_batches,
        "use_stateful_dataloader": accelerator.use_stateful_dataloader,
        "log_with": list(accelerator.log_with),
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "release_memory": release_memory(torch.ones(1), torch.ones(1)),
    }
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as part:
        row["split_padded"] = part
    with accelerator.split_between_processes({"a": [1, 2, 3], "b": torch.arange(3)}) as part:
        row["split_dict"] = [part["a"], part["b"].tolist()]

    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def fits(batch_size):
        tried.append(batch_size)
        if batch_size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return batch_size

    row["find_executable_batch_size"] = [fits(), list(tried)]
    row["find_executable_batch_size_again"] = [fits(), tried]

    torch.manual_seed(1000 + rank)
    synchronize_rng_states(["torch"])
    row["rng_after_sync"] = torch.rand(2).tolist()

    set_seed(0)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(RegressionDataset(length=32, seed=7), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append(accelerator.sync_gradients)
    unwrapped = accelerator.unwrap_model(model)
    row["sync_gradients"] = steps
    row["trained"] = [round(unwrapped.a.item(), 5), round(unwrapped.b.item(), 5)]

    rows = gather_object([row])
    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
