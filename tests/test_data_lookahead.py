"""``accelkit.data.lookahead.upcoming_batches``: the next batches a prepared loader hands out,
computed from its state without handing them out or changing any generator."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from accelkit.data.lookahead import sampler_summary, upcoming_batches
from accelkit.data.preparation import DataLoaderConfiguration, prepare_data_loader


def _rng() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state()


def _prepared(kind: str, stateful: bool = False) -> Any:
    torch.manual_seed(0)
    data = torch.arange(20)
    if kind == "distributed":
        sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=5)
        loader = DataLoader(data, batch_size=3, sampler=sampler)
    else:
        loader = DataLoader(data, batch_size=3, shuffle=kind != "sequential")
    config = DataLoaderConfiguration(
        use_seedable_sampler=kind == "seedable", use_stateful_dataloader=stateful
    )
    return prepare_data_loader(loader, config=config)


@pytest.mark.parametrize("kind", ["shuffled", "seedable", "sequential", "distributed"])
@pytest.mark.parametrize("stateful", [False, True])
def test_the_predicted_batches_are_the_ones_that_come(kind: str, stateful: bool) -> None:
    if stateful:
        pytest.importorskip("torchdata")
    loader = _prepared(kind, stateful)
    for epoch in range(2):  # the second epoch's order is drawn again (shuffled kinds)
        assert upcoming_batches(loader, 2) == [b.tolist() for b in list(loader)[:2]]
        it = iter(loader)
        taken = [next(it).tolist() for _ in range(2)]
        python, numpy, torch_state = _rng()
        predicted = upcoming_batches(loader, 3)
        assert _rng()[:2] == (python, numpy)  # no generator moved
        assert torch.equal(_rng()[2], torch_state)
        rest = [b.tolist() for b in it]
        assert predicted == rest[:3], (epoch, taken)
    assert upcoming_batches(loader, 100) is not None


def test_a_restored_position_is_predicted_before_the_pass_starts() -> None:
    loader = _prepared("shuffled")
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    expected = [b.tolist() for b in it][:2]
    fresh = _prepared("shuffled")
    torch.manual_seed(123)  # the restored randomness decides, not the global RNG
    fresh.load_state_dict(state)
    assert upcoming_batches(fresh, 2) == expected
    assert [b.tolist() for b in fresh][:2] == expected


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(10))


def test_an_iterable_dataset_has_no_indices_ahead() -> None:
    loader = prepare_data_loader(DataLoader(_Stream(), batch_size=2))
    assert upcoming_batches(loader, 2) is None
    assert upcoming_batches(DataLoader(range(4)), 2) is None  # not prepared


def test_the_sampler_summary_names_class_size_and_seed() -> None:
    assert sampler_summary(_prepared("distributed")) == "DistributedSampler over 20 samples, seed 5"
    assert sampler_summary(_prepared("sequential")) == "SequentialSampler over 20 samples"
