"""Dataloader sharding, shuffling, end detection, position and skipping (single process).

Shards of several processes are built side by side in one process (``num_processes=P`` with
each ``process_index``): the sharding rule is pure, so this checks it without spawning workers.
The real multi-process runs are in ``tests/test_training.py``, ``tests/test_resume_idiom.py``
and ``tests/test_data_loader.py``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from accelkit.data.preparation import (
    DataLoaderConfiguration,
    PreparedDataLoader,
    prepare_data_loader,
    resolve_config,
    skip_first_batches,
)
from accelkit.data.sampling import BatchSamplerShard, IterableDatasetShard
from accelkit.training.optim import GradientState


def _items(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in (b.tolist() if isinstance(b, torch.Tensor) else b)]


# ------------------------------------------------------------------------- the sharding rule


@pytest.mark.parametrize("n", [1, 3, 8, 9, 10, 17])
@pytest.mark.parametrize("bs", [1, 2, 4])
@pytest.mark.parametrize("procs", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_dealt_shards_cover_every_sample_once_with_equal_full_batches(
    n: int, bs: int, procs: int, drop_last: bool
) -> None:
    base = BatchSampler(SequentialSampler(range(n)), bs, drop_last)
    shards = [BatchSamplerShard(base, procs, r) for r in range(procs)]
    per = [list(s) for s in shards]
    # equal counts, every batch full, len() right
    assert len({len(p) for p in per}) == 1
    assert all(len(b) == bs for p in per for b in p)
    assert [len(s) for s in shards] == [len(p) for p in per]
    # interleave rank by rank: the gathered order is the dataset order, then the padding
    gathered = [i for rnd in zip(*per) for b in rnd for i in b]
    if drop_last:
        kept = (n // bs // procs) * procs * bs
        assert gathered == list(range(kept))
    else:
        assert gathered[:n] == list(range(n))
        assert set(gathered[n:]) <= set(range(n))  # padding only repeats real samples
        assert len(gathered) - n < procs * bs


@pytest.mark.parametrize("n", [5, 9, 16])
def test_uneven_shards_without_even_batches_lose_and_repeat_nothing(n: int) -> None:
    base = BatchSampler(SequentialSampler(range(n)), 2, False)
    per = [list(BatchSamplerShard(base, 2, r, even_batches=False)) for r in range(2)]
    assert sorted(_items(per[0]) + _items(per[1])) == list(range(n))
    for r, shard in enumerate(per):
        assert len(BatchSamplerShard(base, 2, r, even_batches=False)) == len(shard)


@pytest.mark.parametrize("n", [7, 8, 9])
def test_split_batches_slices_each_batch(n: int) -> None:
    base = BatchSampler(SequentialSampler(range(n)), 4, False)
    per = [list(BatchSamplerShard(base, 2, r, split_batches=True)) for r in range(2)]
    assert len(per[0]) == len(per[1]) == len(base)
    assert per[0][0] == [0, 1] and per[1][0] == [2, 3]
    gathered = [i for rnd in zip(*per) for b in rnd for i in b]
    assert gathered[:n] == list(range(n))


def test_split_batches_needs_a_divisible_batch_size() -> None:
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    with pytest.raises(ValueError, match="batch_size=3 on 2 processes"):
        BatchSamplerShard(base, 2, 0, split_batches=True)


class _Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


@pytest.mark.parametrize("n", [8, 9, 3])
def test_iterable_shards_cover_every_sample_and_record_the_remainder(n: int) -> None:
    shards = [IterableDatasetShard(_Stream(n), 4, 2, r) for r in range(2)]
    per = [list(s) for s in shards]
    assert len(per[0]) == len(per[1])
    gathered = [i for k in range(0, len(per[0]), 2) for p in per for i in p[k : k + 2]]
    assert gathered[:n] == list(range(n))
    assert shards[0].last_remainder == n % 4


# ------------------------------------------------------------------- prepared dataloaders


SEEDABLE = True  # passed as use_seedable_sampler: these tests replay orders from (seed, epoch)


def _prepare(loader: DataLoader[Any], procs: int = 1, rank: int = 0, **config: Any) -> Any:
    return prepare_data_loader(
        loader,
        num_processes=procs,
        process_index=rank,
        config=DataLoaderConfiguration(**config),
        gradient_state=GradientState(),
    )


def test_shuffling_is_identical_across_processes_and_changes_per_epoch() -> None:
    data = torch.arange(20)
    shards = [
        _prepare(
            DataLoader(data, batch_size=2, shuffle=True),
            2,
            r,
            use_seedable_sampler=SEEDABLE,
            data_seed=7,
        )
        for r in range(2)
    ]
    epochs = []
    for _ in range(2):
        per = [[b.tolist() for b in s] for s in shards]
        order = [i for rnd in zip(*per) for b in rnd for i in b]
        assert sorted(order) == list(range(20))  # every sample once per epoch
        epochs.append(order)
    assert epochs[0] != epochs[1]
    assert epochs[0] != list(range(20))
    # the order is a function of (seed, epoch): a fresh loader replays it
    again = _prepare(
        DataLoader(data, batch_size=4, shuffle=True), use_seedable_sampler=SEEDABLE, data_seed=7
    )
    assert _items(list(again)) == epochs[0]
    assert shards[0].epoch == 2


def test_seed_defaults_to_torch_initial_seed() -> None:
    torch.manual_seed(123)
    a = _prepare(
        DataLoader(torch.arange(10), batch_size=5, shuffle=True), use_seedable_sampler=True
    )
    torch.manual_seed(123)
    b = _prepare(
        DataLoader(torch.arange(10), batch_size=5, shuffle=True), use_seedable_sampler=True
    )
    assert a.state_dict()["seed"] == 123
    assert _items(list(a)) == _items(list(b))


def test_end_of_dataloader_is_true_exactly_on_the_last_batch() -> None:
    state = GradientState()
    loader = prepare_data_loader(DataLoader(torch.arange(5), batch_size=2), gradient_state=state)
    flags = []
    for _ in loader:
        assert state.active_dataloader is loader
        flags.append((loader.end_of_dataloader, state.end_of_dataloader))
    assert flags == [(False, False), (False, False), (True, True)]
    assert not state.in_dataloader and not state.end_of_dataloader


def test_nested_loaders_report_the_innermost() -> None:
    state = GradientState()
    outer = prepare_data_loader(DataLoader(torch.arange(2)), gradient_state=state)
    inner = prepare_data_loader(DataLoader(torch.arange(3)), gradient_state=state)
    for _ in outer:
        seen = [state.end_of_dataloader for _ in inner]
        assert seen == [False, False, True]
        assert state.active_dataloader is outer
    assert not state.in_dataloader


def test_abandoned_iteration_leaves_the_gradient_state() -> None:
    state = GradientState()
    loader = prepare_data_loader(DataLoader(torch.arange(6)), gradient_state=state)
    for _ in loader:
        break
    assert not state.in_dataloader


def test_prepared_loader_is_a_dataloader_with_totals() -> None:
    loader = _prepare(DataLoader(torch.arange(9), batch_size=2), 2, 1)
    assert isinstance(loader, DataLoader) and isinstance(loader, PreparedDataLoader)
    assert loader.total_batch_size == 4 and loader.total_dataset_length == 9
    assert loader.remainder == 1 and len(loader) == 3
    assert prepare_data_loader(loader) is loader


def test_mid_epoch_resume_continues_where_it_stopped() -> None:
    def make() -> Any:
        return _prepare(
            DataLoader(torch.arange(24), batch_size=3, shuffle=True),
            use_seedable_sampler=SEEDABLE,
            data_seed=1,
        )

    first = make()
    list(first)  # finish epoch 0, so the resume happens in epoch 1
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batches_yielded"] == 3
    rest = [b.tolist() for b in it]

    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    assert resumed.epoch == 2
    # the next epoch is a normal full one
    assert len(list(resumed)) == 8
    assert seen


def test_state_saved_on_the_last_batch_points_to_the_next_epoch() -> None:
    loader = _prepare(
        DataLoader(torch.arange(4), batch_size=2, shuffle=True),
        use_seedable_sampler=SEEDABLE,
        data_seed=3,
    )
    states = [loader.state_dict() for _ in loader]
    assert states[-1] == {
        "epoch": 1,
        "batches_yielded": 0,
        "seed": 3,
        # The start of the next epoch in the global order, too.
        "global_position": {"num_processes": 1, "units": 0, "unit": "batches", "unit_size": 2},
    }
    with pytest.raises(KeyError, match="batches_yielded"):
        loader.load_state_dict({"epoch": 1})


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch(num_workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> Any:
        loader = DataLoader(torch.arange(20), batch_size=2, shuffle=True, num_workers=num_workers)
        return _prepare(
            loader, use_stateful_dataloader=True, use_seedable_sampler=SEEDABLE, data_seed=5
        )

    full = [b.tolist() for b in make()]
    first = make()
    assert isinstance(first, StatefulDataLoader)
    it = iter(first)
    head = [next(it).tolist() for _ in range(4)]
    state = first.state_dict()
    assert "stateful_dataloader" in state and state["batches_yielded"] == 4
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full


def test_stateful_state_on_last_batch_starts_a_fresh_epoch() -> None:
    def make() -> Any:
        return _prepare(DataLoader(torch.arange(6), batch_size=2), use_stateful_dataloader=True)

    first = make()
    state = None
    for _ in first:
        state = first.state_dict()
    resumed = make()
    assert state is not None
    resumed.load_state_dict(state)
    assert _items(list(resumed)) == list(range(6))


def test_skip_first_batches_on_a_prepared_loader_shares_its_position() -> None:
    loader = _prepare(
        DataLoader(torch.arange(12), batch_size=2, shuffle=True),
        use_seedable_sampler=SEEDABLE,
        data_seed=2,
    )
    full = [b.tolist() for b in loader]  # epoch 0
    loader.set_epoch(0)
    skipped = skip_first_batches(loader, 2)
    assert isinstance(skipped, PreparedDataLoader) and len(skipped) == 4
    it = iter(skipped)
    assert next(it).tolist() == full[2]
    assert loader.state_dict()["batches_yielded"] == 3  # the original sees the progress
    assert [b.tolist() for b in it] == full[3:]
    assert loader.epoch == 1  # the skipped pass finished epoch 0 for both


def test_skip_first_batches_on_plain_loaders() -> None:
    plain = DataLoader(torch.arange(10), batch_size=3)
    assert _items(list(skip_first_batches(plain, 2))) == [6, 7, 8, 9]
    stream = DataLoader(_Stream(10), batch_size=3)
    assert _items(list(skip_first_batches(stream, 3))) == [9]
    with pytest.raises(ValueError, match="num_batches=-1"):
        skip_first_batches(plain, -1)
    with pytest.raises(TypeError, match="list"):
        skip_first_batches([1, 2], 1)


def test_iterable_loader_is_sharded_and_skips_by_reading() -> None:
    shards = [_prepare(DataLoader(_Stream(9), batch_size=2), 2, r) for r in range(2)]
    per = [[b.tolist() for b in s] for s in shards]
    assert len(per[0]) == len(per[1]) == 3
    assert [i for rnd in zip(*per) for b in rnd for i in b][:9] == list(range(9))
    assert shards[0].remainder == 1  # learnt from the stream (no len())
    skipped = skip_first_batches(shards[1], 1)
    assert [b.tolist() for b in skipped] == per[1][1:]


def test_resolve_config_and_bad_input() -> None:
    assert resolve_config(None, True).split_batches is True
    assert resolve_config(DataLoaderConfiguration(even_batches=False)).even_batches is False
    with pytest.raises(TypeError, match="DataLoaderConfiguration"):
        resolve_config({"split_batches": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got list"):
        prepare_data_loader([1, 2, 3])  # type: ignore[arg-type]


def test_custom_batch_sampler_is_kept_and_sharded() -> None:
    class Pairs(BatchSampler):
        pass

    base = Pairs(SequentialSampler(range(8)), 2, False)
    shards = [_prepare(DataLoader(torch.arange(8), batch_sampler=base), 2, r) for r in range(2)]
    counts = Counter(_items(list(itertools.chain(*shards))))
    assert sorted(counts) == list(range(8)) and set(counts.values()) == {1}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_are_moved_to_cuda() -> None:
    loader = prepare_data_loader(
        DataLoader(torch.arange(4), batch_size=2, pin_memory=True),
        device=torch.device("cuda", 0),
        config=DataLoaderConfiguration(non_blocking=True),
    )
    assert all(b.device.type == "cuda" for b in loader)


def test_one_process_never_pads() -> None:
    stream = _prepare(DataLoader(_Stream(10), batch_size=3))
    assert [len(b) for b in stream] == [3, 3, 3, 1]
    mapped = _prepare(DataLoader(torch.arange(10), batch_size=3))
    assert _items(list(mapped)) == list(range(10))


def test_loaders_without_automatic_batching_are_sharded_by_item() -> None:
    items = [torch.full((3,), i) for i in range(5)]
    shards = [_prepare(DataLoader(items, batch_size=None), 2, r) for r in range(2)]
    per = [[int(b[0]) for b in s] for s in shards]
    assert per == [[0, 2, 4], [1, 3, 0]]
    streams = [_prepare(DataLoader(_Stream(5), batch_size=None), 2, r) for r in range(2)]
    assert [[int(b) for b in s] for s in streams] == [[0, 2, 4], [1, 3, 0]]
    with pytest.raises(ValueError, match="batch_size=None"):
        _prepare(DataLoader(_Stream(5), batch_size=None), 2, 0, split_batches=True)


@pytest.mark.parametrize("generator", [False, True])
def test_default_shuffle_draws_as_an_unprepared_dataloader(generator: bool) -> None:
    # use_seedable_sampler=False (the default, as in Accelerate): on one process the orders and
    # the global RNG stream (what dropout sees) are those of the unprepared loader.
    def run(prepare: bool) -> list[Any]:
        torch.manual_seed(5)
        gen = torch.Generator().manual_seed(9) if generator else None
        loader: Any = DataLoader(list(range(8)), batch_size=2, shuffle=True, generator=gen)
        if prepare:
            loader = _prepare(loader)
        return [([b.tolist() for b in loader], float(torch.rand(1))) for _ in range(3)]

    reference = run(prepare=False)
    assert run(prepare=True) == reference
    assert len({str(orders) for orders, _ in reference}) == 3  # the epochs differ


def test_a_batch_sampler_given_as_sampler_is_sharded_by_batch() -> None:
    # DataLoader(sampler=BatchSampler(...), batch_size=None): the dataset takes index lists.
    class Rows(torch.utils.data.Dataset[list[int]]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: list[int]) -> list[int]:
            return list(index)

    def shard(rank: int) -> Any:
        sampler = BatchSampler(SequentialSampler(range(10)), 4, False)
        return _prepare(DataLoader(Rows(), sampler=sampler, batch_size=None), 2, rank)

    per = [[list(b) for b in shard(r)] for r in range(2)]
    assert per == [[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]
    assert shard(0).total_batch_size == 8 and shard(0).remainder == 2


class _EpochSampler(SequentialSampler):
    """An inner sampler that records the epochs it is told (as a DistributedSampler needs)."""

    def __init__(self, data: Any, log: list[Any]) -> None:
        super().__init__(data)
        self.log = log

    def set_epoch(self, epoch: int) -> None:
        self.log.append(("sampler", epoch))


class _EpochBatches(BatchSampler):
    """A custom batch sampler with its own set_epoch."""

    def __init__(self, sampler: Any, log: list[Any]) -> None:
        super().__init__(sampler, 2, False)
        self.log = log

    def set_epoch(self, epoch: int) -> None:
        self.log.append(("batch_sampler", epoch))


def _epoch_calls(prepare: Any) -> list[Any]:
    """The set_epoch calls a custom batch sampler and its sampler get through a prepared
    loader: at set_epoch(3), and as each of two passes starts."""
    log: list[Any] = []
    data = torch.arange(8)
    loader = prepare(DataLoader(data, batch_sampler=_EpochBatches(_EpochSampler(data, log), log)))
    log.append("prepared")
    loader.set_epoch(3)
    log.append("set_epoch(3)")
    for _ in range(2):
        list(loader)
        log.append("pass")
    return log


@pytest.mark.parametrize("procs", [1, 2])
def test_set_epoch_reaches_a_custom_batch_sampler_and_its_sampler_as_in_accelerate(
    procs: int,
) -> None:
    accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
    theirs = _epoch_calls(
        lambda loader: accelerate_data_loader.prepare_data_loader(
            loader, num_processes=procs, process_index=0
        )
    )
    ours = _epoch_calls(lambda loader: _prepare(loader, procs, 0))

    def without_batch_sampler(log: list[Any]) -> list[Any]:
        return [
            entry for entry in log if not (isinstance(entry, tuple) and entry[0] == "batch_sampler")
        ]

    assert without_batch_sampler(ours) == without_batch_sampler(theirs)
    if procs == 1:
        assert ours == theirs
    else:
        # Accelerate's shard sits between the loader and the user's batch sampler, so only
        # the inner sampler hears the epoch; accelkit tells the batch sampler too, with the
        # same epochs, whatever the number of processes.
        told = [entry for entry in ours if entry not in without_batch_sampler(ours)]
        assert told == [("batch_sampler", 3), ("batch_sampler", 3), ("batch_sampler", 4)]
