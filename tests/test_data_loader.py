"""``accelkit.data_loader`` against the installed ``accelerate.data_loader``.

* Every public name Accelerate defines there exists here (unless listed out of scope, with the
  reason), and its signature binds the same way: the same parameters, in the same order, with
  the same defaults.
* The samplers give the same batches as Accelerate's for the same arguments.
* The same script gives the same shuffled batches, and leaves the global RNG where Accelerate
  leaves it, on 1 and 2 real processes, with and without ``use_seedable_sampler``.
* Prepared dataloaders pickle.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import accelkit.data_loader as ours
from accelkit.data.preparation import DataLoaderConfiguration
from tests.helpers.distributed import run_distributed

theirs = pytest.importorskip("accelerate.data_loader")

OUT_OF_SCOPE = {
    "DataLoaderAdapter": "the reference's wrapping base class; prepared loaders are DataLoader "
    "subclasses, not wrappers",
    "MpDeviceLoaderWrapper": "TPU/XLA execution is out of scope",
}


def _public_names() -> list[str]:
    return sorted(
        name
        for name, value in vars(theirs).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == theirs.__name__
    )


def test_the_reference_defines_the_names_this_test_expects() -> None:
    names = _public_names()
    # a guard: if the reference is changed, the test below must still see its names
    for name in ("prepare_data_loader", "skip_first_batches", "SeedableRandomSampler"):
        assert name in names


def _params(obj: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(obj).parameters.values())


@pytest.mark.parametrize("name", _public_names())
def test_each_public_name_exists_and_binds_the_same_way(name: str) -> None:
    if name in OUT_OF_SCOPE:
        assert not hasattr(ours, name), f"{name} is listed out of scope but exists"
        return
    assert hasattr(ours, name), f"accelkit.data_loader lacks {name}"
    theirs_params = _params(getattr(theirs, name))
    ours_params = _params(getattr(ours, name))
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [p for p in theirs_params if p.kind not in var]
    for index, param in enumerate(named):
        mine = ours_params[index]
        assert (mine.name, mine.kind, mine.default) == (param.name, param.kind, param.default), (
            f"{name}: parameter {index} is {mine} here, {param} in accelerate"
        )
    if not named:  # (*args, **kwargs) forwarding to a base class: checked by its own test
        return
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in theirs_params):
        assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours_params), name
    # anything more here must be optional, so every call to the reference binds here too
    for extra in ours_params[len(named) :]:
        assert extra.kind in var or extra.default is not inspect.Parameter.empty, (name, extra)


def test_seedable_sampler_takes_the_references_arguments_and_orders() -> None:
    data = list(range(12))
    generator = torch.Generator()
    kwargs: dict[str, Any] = {"data_source": data, "num_samples": 12, "data_seed": 7}
    mine = ours.SeedableRandomSampler(generator=generator, **kwargs)
    ref = theirs.SeedableRandomSampler(generator=torch.Generator(), **kwargs)
    assert [list(mine) for _ in range(3)] == [list(ref) for _ in range(3)]
    assert mine.epoch == ref.epoch == 3
    torch.manual_seed(11)
    assert ours.SeedableRandomSampler(data).initial_seed == 11


@pytest.mark.parametrize("n", [7, 8, 10])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("even", [False, True])
def test_batch_sampler_shard_matches_the_reference(n: int, split: bool, even: bool) -> None:
    base = BatchSampler(SequentialSampler(range(n)), 4, False)
    for rank in range(2):
        mine = ours.BatchSamplerShard(base, 2, rank, split, even)
        ref = theirs.BatchSamplerShard(base, 2, rank, split, even)
        assert list(mine) == list(ref) and len(mine) == len(ref), (rank, n, split, even)


class _Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


@pytest.mark.parametrize("n", [8, 9, 13])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_shard_matches_the_reference(n: int, drop_last: bool) -> None:
    for rank in range(2):
        mine = ours.IterableDatasetShard(_Stream(n), 2, drop_last, 2, rank)
        ref = theirs.IterableDatasetShard(_Stream(n), 2, drop_last, 2, rank)
        assert list(mine) == list(ref), (rank, n, drop_last)


def test_skip_helpers_match_the_reference() -> None:
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    assert list(ours.SkipBatchSampler(base, 2)) == list(theirs.SkipBatchSampler(base, 2))
    assert len(ours.SkipBatchSampler(base, 2)) == len(theirs.SkipBatchSampler(base, 2)) == 2
    assert ours.SkipBatchSampler(base, 2).total_length == 4
    loader = ours.SkipDataLoader(_Stream(10), 2, batch_size=3)
    assert [b.tolist() for b in loader] == [[6, 7, 8], [9]]
    plain = DataLoader(list(range(10)), batch_size=3)
    assert [b.tolist() for b in ours.skip_first_batches(plain, 3)] == [[9]]


def test_prepare_data_loader_binds_positionally_and_shards() -> None:
    loader = DataLoader(list(range(8)), batch_size=2)
    shards = [ours.prepare_data_loader(loader, None, 2, rank) for rank in range(2)]
    assert [[b.tolist() for b in s] for s in shards] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert isinstance(shards[0], ours.DataLoaderShard)
    assert isinstance(shards[0], ours.DataLoaderStateMixin)
    assert not isinstance(loader, ours.DataLoaderShard)
    assert ours.get_sampler(shards[0]) is loader.sampler
    with pytest.raises(ValueError, match="torch_device_mesh"):
        ours.prepare_data_loader(loader, torch_device_mesh="mesh")


def test_data_loader_shard_constructs_a_prepared_loader() -> None:
    shard = ours.DataLoaderShard(list(range(6)), batch_size=2, skip_batches=1, iteration=3)
    assert isinstance(shard, ours.DataLoaderShard) and isinstance(shard, DataLoader)
    assert shard.iteration == 3
    assert [b.tolist() for b in shard] == [[2, 3], [4, 5]]
    assert [b.tolist() for b in shard] == [[2, 3], [4, 5]]  # the reference skips every pass
    assert shard.iteration == 5


def test_the_configuration_defaults_and_field_order_are_the_references() -> None:
    from accelerate.utils import DataLoaderConfiguration as Reference

    ref_fields = list(Reference.__dataclass_fields__.values())
    mine = DataLoaderConfiguration.__dataclass_fields__
    assert list(mine) == [f.name for f in ref_fields]
    for field in ref_fields:
        assert mine[field.name].default == field.default, field.name
    assert DataLoaderConfiguration().use_seedable_sampler is False


# ------------------------------------------------------------- same script, same batches


def _script(package: str, seedable: bool) -> dict[str, Any]:
    """The same few lines of a training script, on accelerate or on accelkit."""
    if package == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration as Config
        from accelerate.utils import set_seed
    else:
        from accelkit import Accelerator, set_seed
        from accelkit import DataLoaderConfiguration as Config

    set_seed(42)
    acc = Accelerator(cpu=True, dataloader_config=Config(use_seedable_sampler=seedable))
    generator = torch.Generator().manual_seed(3)
    loaders = acc.prepare(
        DataLoader(list(range(20)), batch_size=2, shuffle=True),
        DataLoader(list(range(12)), batch_size=3, shuffle=True, generator=generator),
    )
    out: dict[str, Any] = {"batches": [], "rng": []}
    for _ in range(3):
        for loader in loaders:
            out["batches"].append([b.tolist() for b in loader])
            out["rng"].append(float(torch.rand(1)))
    return out


def _both(seedable: bool) -> dict[str, Any]:
    return {package: _script(package, seedable) for package in ("accelerate", "accelkit")}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("seedable", [False, True])
def test_the_same_script_gives_the_references_batches(world_size: int, seedable: bool) -> None:
    # Each package in its own processes: the reference keeps process-wide state.
    ref = run_distributed(_script, "accelerate", seedable, world_size=world_size)
    got = run_distributed(_script, "accelkit", seedable, world_size=world_size)
    for rank in range(world_size):
        assert got[rank]["batches"] == ref[rank]["batches"], rank
        assert got[rank]["rng"] == ref[rank]["rng"], rank
    epochs = [tuple(map(tuple, e)) for e in ref[0]["batches"][::2]]
    assert len(set(epochs)) == 3  # shuffled differently each epoch


# ------------------------------------------------------------------------------ pickling


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("iterable", [False, True])
def test_prepared_dataloaders_pickle_with_their_position(stateful: bool, iterable: bool) -> None:
    from accelkit import Accelerator

    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)
    )
    dataset: Any = _Stream(12) if iterable else list(range(12))
    loader = acc.prepare(DataLoader(dataset, batch_size=2, shuffle=not iterable))
    first = [b.tolist() for b in loader]
    copy = pickle.loads(pickle.dumps(loader))
    assert type(copy) is type(loader) and copy.epoch == loader.epoch == 1
    rng = torch.get_rng_state()  # the next epoch's shuffle draws from it
    again = [b.tolist() for b in copy]
    torch.set_rng_state(rng)
    assert again == [b.tolist() for b in loader]  # the same next epoch
    skipped = pickle.loads(pickle.dumps(acc.skip_first_batches(loader, 2)))
    assert skipped.epoch == 2
    assert len([b for b in skipped]) == len(first) - 2
