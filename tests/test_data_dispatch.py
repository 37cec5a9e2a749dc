"""Dispatching (``dispatch_batches``): the main process reads, every process gets its slice.

Multi-process cases run on two real gloo processes; the main process's dataset differs from the
other's (it yields values offset by the rank), so a result that holds only the main process's
values shows that only the main process read.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from accelkit.data.preparation import (
    DataLoaderConfiguration,
    prepare_data_loader,
    skip_first_batches,
)
from accelkit.data_loader import DataLoaderDispatcher
from accelkit.data_loader import prepare_data_loader as reference_style_prepare
from tests.helpers.distributed import run_distributed

CPU = torch.device("cpu")


class _RankStream(IterableDataset[torch.Tensor]):
    """0..n-1, plus 100 * the reading process's rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        offset = 100 * (dist.get_rank() if dist.is_initialized() else 0)
        return iter(torch.arange(self.n) + offset)

    def __len__(self) -> int:
        return self.n


def _dispatched(loader: DataLoader[Any], **config: Any) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    return prepare_data_loader(
        loader,
        num_processes=world,
        process_index=rank,
        device=CPU,
        config=DataLoaderConfiguration(dispatch_batches=True, **config),
    )


def _passes(loader: Any) -> dict[str, Any]:
    batches, ends = [], []
    for batch in loader:
        batches.append(batch.tolist())
        ends.append(loader.end_of_dataloader)
    return {"batches": batches, "ends": ends, "remainder": loader.remainder, "len": len(loader)}


def _body_slices() -> dict[str, Any]:
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    # 11 items, batches of 2: rounds [0..3], [4..7], then [8, 9, 10] completed with [0, 1].
    out["plain"] = _passes(_dispatched(DataLoader(_RankStream(11), batch_size=2)))
    out["split"] = _passes(
        _dispatched(DataLoader(_RankStream(8), batch_size=4), split_batches=True)
    )
    out["drop_last"] = _passes(
        _dispatched(DataLoader(torch.arange(11), batch_size=2, drop_last=True))
    )
    out["dicts"] = [
        {k: v.tolist() for k, v in b.items()}
        for b in _dispatched(DataLoader([{"x": i, "y": -i} for i in range(4)], batch_size=1))
    ]
    out["skipped"] = [
        b.tolist()
        for b in skip_first_batches(_dispatched(DataLoader(_RankStream(8), batch_size=2)), 1)
    ]
    # Accelerate's default (dispatch_batches=None) dispatches an IterableDataset placed on the
    # device, and shards it when batches are not placed.
    default = prepare_data_loader(
        DataLoader(_RankStream(4), batch_size=1),
        num_processes=2,
        process_index=dist.get_rank(),
        device=CPU,
    )
    out["default"] = [b.tolist() for b in default]
    unplaced = prepare_data_loader(
        DataLoader(_RankStream(4), batch_size=1), num_processes=2, process_index=dist.get_rank()
    )
    out["unplaced"] = [b.tolist() for b in unplaced]
    # A slice_fn decides each process's part.
    reversed_parts = reference_style_prepare(
        DataLoader(_RankStream(4), batch_size=2),
        CPU,
        put_on_device=True,
        dispatch_batches=True,
        slice_fn_for_dispatch=lambda b, s, process_index, num_processes: b.flip(0)[s],
    )
    out["slice_fn"] = [b.tolist() for b in reversed_parts]
    return out


def test_the_main_process_reads_and_every_process_gets_its_slice() -> None:
    rank0, rank1 = run_distributed(_body_slices)
    assert rank0["plain"] == {
        "batches": [[0, 1], [4, 5], [8, 9]],
        "ends": [False, False, True],
        "remainder": 3,
        "len": 3,
    }
    assert rank1["plain"]["batches"] == [[2, 3], [6, 7], [10, 0]]
    assert rank1["plain"]["remainder"] == 3
    assert rank0["split"]["batches"] == [[0, 1], [4, 5]]
    assert rank1["split"]["batches"] == [[2, 3], [6, 7]]
    # drop_last: the incomplete last round ([8, 9] alone) is dropped; len is 5 // 2.
    assert rank0["drop_last"]["batches"] == [[0, 1], [4, 5]]
    assert rank1["drop_last"]["batches"] == [[2, 3], [6, 7]]
    assert rank0["drop_last"]["len"] == rank1["drop_last"]["len"] == 2
    assert rank0["dicts"] == [{"x": [0], "y": [0]}, {"x": [2], "y": [-2]}]
    assert rank1["dicts"] == [{"x": [1], "y": [-1]}, {"x": [3], "y": [-3]}]
    assert rank0["skipped"] == [[4, 5]] and rank1["skipped"] == [[6, 7]]
    assert rank0["default"] == [[0], [2]] and rank1["default"] == [[1], [3]]
    assert rank1["unplaced"] == [[101], [103]]  # rank 1 read its own stream
    assert rank0["slice_fn"] == [[3, 2]] and rank1["slice_fn"] == [[1, 0]]


def _body_accelerator() -> list[int]:
    from accelkit import Accelerator

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = accelerator.prepare(DataLoader(torch.arange(7), batch_size=2, shuffle=True))
    seen: list[int] = []
    for batch in loader:
        seen += accelerator.gather_for_metrics(batch).tolist()
    assert accelerator.dispatch_batches is True
    return seen


@pytest.mark.slow
def test_gather_for_metrics_drops_the_padding_of_a_dispatched_epoch() -> None:
    rank0, rank1 = run_distributed(_body_accelerator)
    assert rank0 == rank1
    assert sorted(rank0) == list(range(7))


def test_one_process_dispatches_whole_batches_and_pickles() -> None:
    loader = prepare_data_loader(
        DataLoader(torch.arange(5), batch_size=2),
        device=CPU,
        config=DataLoaderConfiguration(dispatch_batches=True),
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert loader.remainder == 1 and len(loader) == 3
    again = pickle.loads(pickle.dumps(loader))
    assert [b.tolist() for b in again] == [[0, 1], [2, 3], [4]]
    dispatcher = DataLoaderDispatcher(torch.arange(4), batch_size=2)
    assert [b.tolist() for b in dispatcher] == [[0, 1], [2, 3]]


def test_dispatching_refuses_what_it_cannot_do() -> None:
    loader = DataLoader(torch.arange(6), batch_size=3)
    with pytest.raises(ValueError, match="put_on_device=True"):
        reference_style_prepare(loader, CPU, 1, 0, dispatch_batches=True)
    with pytest.raises(ValueError, match="needs the batches placed on the device"):
        prepare_data_loader(loader, config=DataLoaderConfiguration(dispatch_batches=True))
    with pytest.raises(ValueError, match="batch_size=3 for 2 processes"):
        prepare_data_loader(
            loader,
            num_processes=2,
            device=CPU,
            config=DataLoaderConfiguration(dispatch_batches=True, split_batches=True),
        )


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(10))


def test_one_process_passes_non_tensor_values_through_as_accelerate_does() -> None:
    """On one process nothing is sent: a batch holding strings (an IterableDataset's default
    loader dispatches) and ``broadcast`` of non-tensors come back as they are."""
    from accelkit import Accelerator
    from accelkit.utils import broadcast

    def collate(features: list[torch.Tensor]) -> dict[str, Any]:
        return {"tensor": torch.stack(features), "non_tensor": "non_tensor_value"}

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare_data_loader(
        DataLoader(_Stream(), batch_size=4, collate_fn=collate)
    )
    batches = list(loader)
    assert [b["tensor"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(b["non_tensor"] == "non_tensor_value" for b in batches)
    assert loader.remainder == 2
    value = {"a": "text", "b": [1, torch.ones(2)]}
    assert broadcast(value) is value
