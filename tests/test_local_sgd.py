"""``accelkit.local_sgd.LocalSGD`` (Accelerate's API) on two real gloo processes: inside the
block each process steps on its own gradients, every ``local_sgd_steps`` steps the parameters
become the mean of the processes' parameters, and after the block they are identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accelkit import Accelerator
from accelkit.local_sgd import LocalSGD
from tests.helpers.distributed import run_distributed


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _body() -> dict[str, Any]:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(40, 3)
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, 4))
    out: dict[str, Any] = {"before_average": [], "after_step": [], "grads": []}
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=3) as local_sgd:
        for step, (inputs, targets) in enumerate(loader):  # 5 steps per process
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            out["grads"].append(model.module.weight.grad.reshape(-1).tolist())
            optimizer.step()
            optimizer.zero_grad()
            out["before_average"].append(_flat(model))
            local_sgd.step()
            out["after_step"].append(_flat(model))
            if step == 4:
                break
        out["num_steps"] = local_sgd.num_steps
    out["after_block"] = _flat(model)
    return out


@pytest.mark.slow
def test_parameters_are_averaged_every_local_sgd_steps_on_two_processes() -> None:
    rank0, rank1 = run_distributed(_body)
    assert rank0["num_steps"] == rank1["num_steps"] == 5
    # no_sync: each process's gradients are its own (DDP would have averaged them).
    assert all(g0 != g1 for g0, g1 in zip(rank0["grads"], rank1["grads"]))
    for step in range(5):
        before = (rank0["before_average"][step], rank1["before_average"][step])
        after = (rank0["after_step"][step], rank1["after_step"][step])
        if (step + 1) % 3 == 0:  # step 3: the mean of both processes' parameters, on both
            mean = [(a + b) / 2 for a, b in zip(*before)]
            assert after[0] == pytest.approx(mean, abs=1e-7)
            assert after[0] == after[1]
        else:  # between averagings the processes drift apart
            assert after == before and after[0] != after[1]
    # Leaving the block averages once more: identical parameters everywhere.
    assert rank0["after_block"] == rank1["after_block"]
    mean = [(a + b) / 2 for a, b in zip(rank0["after_step"][4], rank1["after_step"][4])]
    assert rank0["after_block"] == pytest.approx(mean, abs=1e-7)


def test_one_process_or_disabled_is_a_no_op_and_bad_steps_are_refused() -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=1) as local_sgd:
        assert not local_sgd.enabled
        local_sgd.step()
    assert local_sgd.num_steps == 1
    with pytest.raises(ValueError, match=r"local_sgd_steps=0 must be a positive integer"):
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=0)


def test_fsdp_is_refused_by_name_with_the_fix() -> None:
    # LocalSGD averages a DDP model's full parameters; under FSDP each process holds only a
    # shard, so averaging "the parameters" would mix shards: refused before anything runs.
    from accelkit import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    assert accelerator.distributed_type == DistributedType.FSDP
    model = torch.nn.Linear(2, 1)
    with pytest.raises(NotImplementedError, match=r"this run is FSDP\. Use plain data-parallel"):
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=4)
    # The fix the message names works: switched off, it is a no-op on any layout.
    with LocalSGD(accelerator, model, local_sgd_steps=4, enabled=False) as local_sgd:
        before = [p.detach().clone() for p in model.parameters()]
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
