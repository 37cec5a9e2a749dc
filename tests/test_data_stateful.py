"""Loaders on torchdata's ``StatefulDataLoader`` as Accelerate builds them: dispatching ones,
``SkipDataLoader``, Accelerate's own state dicts, and the global RNG draw that ``prepare`` makes.

The dispatching cases run on two real gloo processes; the main process's dataset differs from
the other's (offset by 100 * rank), so batches holding only the main process's values show that
only the main process read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from accelkit.data.preparation import DataLoaderConfiguration, SkipDataLoader
from accelkit.data_loader import DataLoaderDispatcher, DataLoaderShard
from tests.helpers.distributed import run_distributed

torchdata = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata extra")
StatefulDataLoader = torchdata.StatefulDataLoader

STATEFUL_DISPATCH = DataLoaderConfiguration(dispatch_batches=True, use_stateful_dataloader=True)


class _RankRange(torch.utils.data.Dataset[torch.Tensor]):
    """0..n-1, plus 100 * the reading process's rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i + 100 * (dist.get_rank() if dist.is_initialized() else 0))

    def __len__(self) -> int:
        return self.n


class _RankStream(IterableDataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        offset = 100 * (dist.get_rank() if dist.is_initialized() else 0)
        return iter(torch.arange(self.n) + offset)


def _lists(batches: Any) -> list[list[int]]:
    return [b.tolist() for b in batches]


def _body_dispatch_resume(project: str) -> dict[str, Any]:
    from accelkit import Accelerator

    def training() -> tuple[Any, Any]:
        acc = Accelerator(dataloader_config=STATEFUL_DISPATCH, project_dir=project)
        loader = acc.prepare(DataLoader(_RankRange(12), batch_size=1, shuffle=True))
        return acc, loader

    torch.manual_seed(3)
    acc, loader = training()
    out: dict[str, Any] = {"stateful": isinstance(loader, StatefulDataLoader)}
    uninterrupted, state = [], None
    for epoch in range(2):
        for i, batch in enumerate(loader):
            uninterrupted.append(batch.tolist())
            if epoch == 0 and i == 1:
                acc.save_state(f"{project}/ckpt")
                state = loader.state_dict()
    out["uninterrupted"] = uninterrupted
    acc.end_training()

    # Another run resumes from the checkpoint: the rest of epoch 0, then epoch 1.
    torch.manual_seed(99)  # load_state puts back the RNG states; the seed must not matter
    acc, loader = training()
    acc.load_state(f"{project}/ckpt")
    out["resumed"] = [b.tolist() for _ in range(2) for b in loader]
    # The loader's own state dict does the same in a fresh loader.
    torch.manual_seed(3)
    _, again = training()
    again.load_state_dict(state)
    out["from_state_dict"] = _lists(again)
    return out


@pytest.mark.slow
def test_stateful_dispatching_resumes_mid_epoch_on_two_processes(tmp_path: Path) -> None:
    rank0, rank1 = run_distributed(_body_dispatch_resume, str(tmp_path))
    for rank in (rank0, rank1):
        assert rank["stateful"]
        uninterrupted = rank["uninterrupted"]
        assert len(uninterrupted) == 12  # 6 rounds of 2 per epoch, 2 epochs
        # Only the main process read (no value of rank 1's offset dataset anywhere).
        assert all(0 <= v < 12 for batch in uninterrupted for v in batch)
        # save_state after the 2nd batch: the resumed run gives the rest, then epoch 1.
        assert rank["resumed"] == uninterrupted[2:]
        assert rank["from_state_dict"] == uninterrupted[2:6]
    # The two processes got the two halves of every round.
    first_epoch = rank0["uninterrupted"][:6] + rank1["uninterrupted"][:6]
    assert sorted(v for batch in first_epoch for v in batch) == list(range(12))


def test_dispatcher_on_one_process_is_stateful_and_resumes() -> None:
    loader = DataLoaderDispatcher(range(16), batch_size=4, use_stateful_dataloader=True)
    assert isinstance(loader, StatefulDataLoader) and loader.use_stateful_dataloader
    assert loader.base_dataloader is loader
    ends, batches, state = [], [], None
    for i, batch in enumerate(loader):
        batches.append(batch.tolist())
        ends.append(loader.end_of_dataloader)
        if i == 1:
            state = loader.state_dict()
    assert ends == [False, False, False, True]
    again = DataLoaderDispatcher(range(16), batch_size=4, use_stateful_dataloader=True)
    again.load_state_dict(state)
    assert _lists(again) == batches[2:]
    assert _lists(again) == batches  # the restored position was for one pass only


def test_an_iterable_stateful_loader_dispatches_by_default_as_in_accelerate() -> None:
    from accelkit.data.preparation import prepare_data_loader

    loader = prepare_data_loader(
        DataLoader(_RankStream(5), batch_size=2),
        device=torch.device("cpu"),
        config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    assert loader._recipe.dispatch is not None
    assert _lists(loader) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_skip_data_loader_is_a_stateful_dataloader(num_workers: int) -> None:
    skip = SkipDataLoader(
        list(range(16)),
        batch_size=4,
        skip_batches=2,
        use_stateful_dataloader=True,
        num_workers=num_workers,
    )
    assert isinstance(skip, SkipDataLoader) and isinstance(skip, StatefulDataLoader)
    assert skip.use_stateful_dataloader and skip.base_dataloader is skip
    assert len(skip) == 2
    it = iter(skip)
    assert next(it).tolist() == [8, 9, 10, 11]
    state = skip.state_dict()
    # Its state is the StatefulDataLoader's, counting the skipped batches: a plain
    # StatefulDataLoader (or a SkipDataLoader skipping nothing) continues from it.
    plain = StatefulDataLoader(list(range(16)), batch_size=4, num_workers=num_workers)
    plain.load_state_dict(state)
    assert _lists(plain) == [[12, 13, 14, 15]]
    resumed = SkipDataLoader(
        list(range(16)), batch_size=4, use_stateful_dataloader=True, num_workers=num_workers
    )
    resumed.load_state_dict(state)
    assert _lists(resumed) == [[12, 13, 14, 15]]
    assert type(SkipDataLoader(list(range(4)), batch_size=2)) is SkipDataLoader


def test_a_prepared_stateful_loader_loads_a_torchdata_state() -> None:
    """Accelerate's stateful loaders save the ``StatefulDataLoader``'s own state dict."""
    reference = StatefulDataLoader(list(range(64)), batch_size=4)
    it = iter(reference)
    expected = [next(it).tolist() for _ in range(7)]
    state = reference.state_dict()
    shard = DataLoaderShard(list(range(64)), batch_size=4, use_stateful_dataloader=True)
    assert [b.tolist() for _, b in zip(range(7), shard)] == expected
    loaded = DataLoaderShard(list(range(64)), batch_size=4, use_stateful_dataloader=True)
    loaded.load_state_dict(state)
    rest = _lists(loaded)
    assert rest == [list(range(i, i + 4)) for i in range(28, 64, 4)]


def _draws_after_prepare(stateful: bool) -> tuple[float, list[list[int]]]:
    """The global RNG's next value after prepare, and the first epoch's order (1 process)."""
    from accelkit import Accelerator

    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)
    )
    torch.manual_seed(0)
    train = acc.prepare(DataLoader(torch.arange(8), batch_size=4, shuffle=True))
    acc.prepare(DataLoader(torch.arange(4), batch_size=2))
    after = torch.rand(1).item()
    torch.manual_seed(0)
    train = acc.prepare(DataLoader(torch.arange(8), batch_size=4, shuffle=True))
    acc.prepare(DataLoader(torch.arange(4), batch_size=2))
    return after, _lists(train)


def test_prepare_draws_from_the_global_rng_for_every_stateful_loader() -> None:
    """As Accelerate does (each stateful loader makes its first iterator when prepared, which
    draws the workers' base seed): two prepared loaders, two draws, before any batch; the first
    epoch's shuffle is then drawn after both, as under Accelerate."""
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()
    torch.empty((), dtype=torch.int64).random_()
    expected_after = torch.rand(1).item()
    torch.manual_seed(0)
    for _ in range(2):
        torch.empty((), dtype=torch.int64).random_()
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    order = torch.randperm(8, generator=torch.Generator().manual_seed(seed)).tolist()
    after, epoch = _draws_after_prepare(stateful=True)
    assert after == expected_after
    assert epoch == [order[:4], order[4:]]
    plain_after, _ = _draws_after_prepare(stateful=False)
    assert plain_after != expected_after  # plain loaders draw at the first batch instead


def _eval_after_save(project: Path, resume: bool) -> list[float]:
    """A stateful evaluation loader prepared but not yet iterated when the checkpoint is made
    (as in a script that evaluates every N steps): iterate it, then draw from torch's RNG."""
    from accelkit import Accelerator

    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    torch.manual_seed(0 if not resume else 99)  # a resumed run's RNG comes from the checkpoint
    loader = accelerator.prepare(StatefulDataLoader(list(range(8)), batch_size=4))
    if resume:
        accelerator.load_state(str(project))
    else:
        accelerator.save_state(str(project))
    values = [v for batch in loader for v in batch.tolist()]
    return [*values, *torch.rand(3).tolist()]


def test_a_loader_not_iterated_before_a_save_draws_nothing_more_after_resume(
    tmp_path: Path,
) -> None:
    """prepare() made the first pass's iterator (and its RNG draw) before the save; the resumed
    run restores the RNG after that draw, so its first pass must not draw again: the random
    numbers after it (dropout in a training step) are the uninterrupted run's."""
    original = _eval_after_save(tmp_path / "ckpt", resume=False)
    resumed = _eval_after_save(tmp_path / "ckpt", resume=True)
    assert resumed == original
