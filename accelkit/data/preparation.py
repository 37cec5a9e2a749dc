"""Prepared dataloaders: sharded across processes, placed on the device, resumable.

:func:`prepare_data_loader` turns a user's ``DataLoader`` into a :class:`PreparedDataLoader` (a
``DataLoader`` subclass, or a torchdata ``StatefulDataLoader`` subclass with
``use_stateful_dataloader=True``) that

* gives each process its share of every epoch (see :mod:`accelkit.data.sampling`): every sample is
  seen once per epoch across processes, and with ``even_batches`` every process gets the same
  number of full batches (the last round is padded by wrapping around);
* shuffles identically on every process: ``shuffle=True`` gets a
  :class:`~accelkit.data.sampling.RecordedRandomSampler` drawing as Accelerate's default does (the
  same orders and global RNG draws for the same script), or with ``use_seedable_sampler`` a
  :class:`~accelkit.data.sampling.SeedableRandomSampler` whose order is a function of the main
  process's seed and the epoch (advanced per full pass, or set by ``set_epoch``);
* moves each batch to the device;
* looks one batch ahead so it knows, while the last batch is being used, that it is the last
  one (gradient accumulation synchronises there; ``gather_for_metrics`` drops the padding);
* or, with ``dispatch_batches`` (by default for an ``IterableDataset`` placed on the device),
  is read on the main process only, which sends every process its slice of each batch (see
  :mod:`accelkit.data.dispatch`);
* reports and restores its position with ``state_dict()``/``load_state_dict()``; a restored
  position applies to the next pass only, and :func:`skip_first_batches` replaces it rather
  than adding to it (see :mod:`accelkit.data.prepared`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accelkit.data.dispatch import Dispatch, SliceFn
from accelkit.data.prepared import PreparedDataLoader, Recipe, build, is_prepared, is_stateful
from accelkit.data.sampling import (
    BatchSamplerShard,
    IterableDatasetShard,
    RecordedRandomSampler,
    SeedableRandomSampler,
    SkipBatchSampler,
    draw_seed,
)
from accelkit.errors import ConfigurationError, DependencyError, WrongTypeError
from accelkit.runtime import ops
from accelkit.training.optim import GradientState

__all__ = [
    "DataLoaderConfiguration",
    "PreparedDataLoader",
    "SkipDataLoader",
    "prepare_data_loader",
    "resolve_config",
    "skip_first_batches",
]

_STATEFUL_MODULE = "torchdata.stateful_dataloader"


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders.

    Args:
        split_batches: split every batch across processes (the script's batch size is the
            global one and must divide by the number of processes) instead of giving each
            process batches of the script's size.
        dispatch_batches: True: the main process reads the dataloader and sends every process
            its slice of each batch (see :mod:`accelkit.data.dispatch`); False: every process reads
            its own share. None (the default, as in Accelerate): True for an
            ``IterableDataset`` whose batches are placed on the device, else False.
        even_batches: give every process the same number of batches by completing the last
            round with samples from the start of the epoch. With False, processes may get
            different numbers of batches (use ``join_uneven_inputs`` when training).
        use_seedable_sampler: shuffle (``shuffle=True`` loaders) with a
            :class:`~accelkit.data.sampling.SeedableRandomSampler`, whose order is a function of
            ``data_seed + epoch``. False (the default, as in Accelerate) shuffles as PyTorch's
            ``RandomSampler`` does, with the same orders as Accelerate for the same script: on
            one process from a seed drawn from the global torch RNG each epoch; on several from
            one generator seeded at ``prepare`` from the main process's global RNG. Either way
            every process draws the same order and a mid-epoch resume replays its epoch.
        data_seed: the seed of the seedable sampler (default: the main process's
            ``torch.initial_seed()``, which ``set_seed`` sets).
        non_blocking: copy batches to the device asynchronously (useful with
            ``pin_memory=True``).
        use_stateful_dataloader: build on torchdata's ``StatefulDataLoader`` so that
            ``state_dict()`` also captures worker and dataset state.
    """

    # Field order as in Accelerate, so positional arguments bind the same way.
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


def resolve_config(
    config: DataLoaderConfiguration | None, split_batches: bool | None = None
) -> DataLoaderConfiguration:
    """The effective configuration: ``config`` (or the default), with ``split_batches`` applied.

    Raises:
        TypeError: if ``config`` is not a :class:`DataLoaderConfiguration`.
    """
    if config is None:
        config = DataLoaderConfiguration()
    elif not isinstance(config, DataLoaderConfiguration):
        raise WrongTypeError(
            f"dataloader_config must be a DataLoaderConfiguration, got {type(config).__name__}; "
            "use dataloader_config=DataLoaderConfiguration(split_batches=..., even_batches=...)."
        )
    if split_batches is not None:
        config = dataclasses.replace(config, split_batches=split_batches)
    return config


def _loader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    for optional in ("in_order", "snapshot_every_n_steps"):
        if hasattr(loader, optional):
            kwargs[optional] = getattr(loader, optional)
    return kwargs


def _is_plain_shuffle(batch_sampler: Any, sampler: Any) -> bool:
    """Whether the loader is ``shuffle=True`` with PyTorch's (or torchdata's) own samplers.

    Only then is the sampler swapped for a :class:`SeedableRandomSampler` or a
    :class:`RecordedRandomSampler`; custom samplers are kept as they are and must shuffle
    identically on every process themselves.
    """
    stateful_sampler = _STATEFUL_MODULE + ".sampler"
    batch_ok = type(batch_sampler) is BatchSampler or (
        type(batch_sampler).__module__ == stateful_sampler
        and type(batch_sampler).__name__ == "BatchSampler"
    )
    sampler_ok = type(sampler) in (RandomSampler, SeedableRandomSampler) or (
        type(sampler).__module__ == stateful_sampler and type(sampler).__name__ == "RandomSampler"
    )
    return batch_ok and sampler_ok


def _seedable_seed(config: DataLoaderConfiguration, distributed: bool) -> int:
    """The seedable sampler's seed: ``data_seed``, else ``torch.initial_seed()`` (as the
    reference), taken from the main process so that every process shuffles alike."""
    seed = int(config.data_seed if config.data_seed is not None else torch.initial_seed())
    if distributed:
        seed = int(ops.broadcast_object_list([seed])[0])
    return seed


def _shared_generator(sampler: Any, distributed: bool) -> torch.Generator | None:
    """The generator a non-seedable shuffle draws from (the reference's choice, so that the
    orders are the same as there).

    One process: the sampler's own (None: a seed from the global RNG each pass). Several: the
    sampler's generator, or a new one seeded from a draw of the global RNG, with the main
    process's state on every process.
    """
    generator: torch.Generator | None = getattr(sampler, "generator", None)
    if not distributed:
        return generator
    if generator is None:
        seed = int(ops.broadcast_object_list([draw_seed()])[0])
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator.set_state(ops.broadcast_object_list([generator.get_state()])[0])
    return generator


def prepare_data_loader(
    dataloader: DataLoader[Any],
    *,
    num_processes: int = 1,
    process_index: int = 0,
    device: torch.device | None = None,
    config: DataLoaderConfiguration | None = None,
    gradient_state: GradientState | None = None,
    slice_fn: SliceFn | None = None,
) -> Any:
    """Shard ``dataloader`` for this process (see the module docstring).

    Args:
        dataloader: the user's dataloader (a prepared one is returned as it is).
        num_processes: processes in the run.
        process_index: this process's index.
        device: where batches go (None: leave them where the collate function put them).
        config: sharding options.
        gradient_state: the accelerator's shared state (a private one if None).
        slice_fn: with dispatching, ``slice_fn(batch, slice, process_index=, num_processes=)``
            takes a process's part of a batch (default: slice every tensor).

    Returns:
        A :class:`PreparedDataLoader` (or its ``StatefulDataLoader`` variant).

    Raises:
        TypeError: if ``dataloader`` is not a ``DataLoader``.
        ValueError: for ``split_batches`` with a batch size not divisible by ``num_processes``;
            for dispatching without a ``device``.
    """
    if is_prepared(dataloader):
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise WrongTypeError(
            f"prepare_data_loader expects a torch.utils.data.DataLoader, got "
            f"{type(dataloader).__name__}. Wrap a dataset as DataLoader(dataset, batch_size=...)."
        )
    config = config or DataLoaderConfiguration()
    kwargs = _loader_kwargs(dataloader)
    dataset = dataloader.dataset
    try:
        length: int | None = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None
    recipe = Recipe(
        stateful=config.use_stateful_dataloader or is_stateful(dataloader),
        dataset=dataset,
        loader_kwargs=kwargs,
        gradient_state=gradient_state or GradientState(),
        device=device,
        non_blocking=config.non_blocking and dataloader.pin_memory,
        total_dataset_length=length,
        drop_last=dataloader.drop_last,
    )
    if _dispatches(config, dataset, device):
        recipe.dispatch = Dispatch(
            num_processes,
            process_index,
            config.split_batches,
            dataloader.drop_last,
            device,
            recipe.non_blocking,
            slice_fn,
        )
        _dispatch_recipe(recipe, dataloader, config, num_processes)
    elif isinstance(dataset, IterableDataset):
        _iterable_recipe(recipe, dataloader, config, num_processes, process_index)
    else:
        _map_recipe(recipe, dataloader, config, num_processes, process_index)
    loader = build(recipe)
    if config.use_stateful_dataloader:
        loader.premake_iterator()  # draws where Accelerate draws (see its docstring)
    return loader


def _dispatches(config: DataLoaderConfiguration, dataset: Any, device: torch.device | None) -> bool:
    """Whether the loader dispatches (``dispatch_batches``, resolving Accelerate's default).

    With a ``StatefulDataLoader`` the main process's loader is the stateful one: its state
    (what the main process has read) is what a resume fast-forwards.

    Raises:
        ValueError: for ``dispatch_batches=True`` without a device.
    """
    if config.dispatch_batches is None:
        return device is not None and isinstance(dataset, IterableDataset)
    if not config.dispatch_batches:
        return False
    if device is None:
        raise ConfigurationError(
            "dispatch_batches=True needs the batches placed on the device (the main process "
            "broadcasts them there): use put_on_device=True / device_placement=True, or "
            "dispatch_batches=False."
        )
    return True


def _dispatch_recipe(
    recipe: Recipe,
    dataloader: DataLoader[Any],
    config: DataLoaderConfiguration,
    num_processes: int,
) -> None:
    """The main process reads with the user's own batching (see :mod:`accelkit.data.dispatch`)."""
    bs = dataloader.batch_size
    batch_sampler: Any = dataloader.batch_sampler
    if bs is None and batch_sampler is not None:
        bs = getattr(batch_sampler, "batch_size", None)
    if config.split_batches and bs is not None and bs > 1 and bs % num_processes:
        raise ConfigurationError(
            f"split_batches=True needs a batch size divisible by the number of processes: "
            f"got batch_size={bs} for {num_processes} processes. Use a batch size that is a "
            f"multiple of {num_processes}."
        )
    if isinstance(recipe.dataset, IterableDataset):
        recipe.dispatch_batching = {"batch_size": bs, "drop_last": dataloader.drop_last}
    elif batch_sampler is None:  # batch_size=None: the sampler gives the items (or batches)
        recipe.dispatch_batching = {"batch_size": None, "sampler": dataloader.sampler}
    else:
        sampler: Any = getattr(batch_sampler, "sampler", None)
        if config.use_seedable_sampler and _is_plain_shuffle(batch_sampler, sampler):
            seedable = SeedableRandomSampler(
                sampler.data_source,
                bool(getattr(sampler, "replacement", False)),
                getattr(sampler, "_num_samples", None),
                sampler.generator,
                data_seed=_seedable_seed(config, num_processes > 1),
            )
            recipe.random_sampler = seedable
            batch_sampler = BatchSampler(
                seedable, batch_sampler.batch_size, batch_sampler.drop_last
            )
        elif _is_plain_shuffle(batch_sampler, sampler) and sampler.generator is None:
            # Shuffles as the user's sampler does, and records the pass's seed so that a
            # resumed pass replays the interrupted one's order.
            recorded = recipe.recorded_sampler = RecordedRandomSampler(
                sampler.data_source,
                bool(getattr(sampler, "replacement", False)),
                getattr(sampler, "_num_samples", None),
            )
            batch_sampler = BatchSampler(
                recorded, batch_sampler.batch_size, batch_sampler.drop_last
            )
        recipe.dispatch_batching = {"batch_sampler": batch_sampler}
    if bs is not None:
        recipe.total_batch_size = bs if config.split_batches else bs * num_processes


def _iterable_recipe(
    recipe: Recipe,
    dataloader: DataLoader[Any],
    config: DataLoaderConfiguration,
    num_processes: int,
    process_index: int,
) -> None:
    bs = dataloader.batch_size
    if bs is None and config.split_batches:
        raise ConfigurationError(
            "split_batches=True cannot split the items of a DataLoader with batch_size=None "
            "(each item is already a batch); use split_batches=False."
        )
    # batch_size=None: every item is a batch; deal the items out one per process.
    total = num_processes if bs is None else bs if config.split_batches else bs * num_processes
    recipe.iterable_shard = IterableDatasetShard(
        recipe.dataset,
        total,
        num_processes,
        process_index,
        dataloader.drop_last,
        config.even_batches,
    )
    length = recipe.total_dataset_length
    if bs is not None and length is not None and not dataloader.drop_last:
        recipe.remainder = length % total if config.even_batches else -1
    recipe.batch_size = None if bs is None else total // num_processes
    recipe.total_batch_size = None if bs is None else total


def _map_recipe(
    recipe: Recipe,
    dataloader: DataLoader[Any],
    config: DataLoaderConfiguration,
    num_processes: int,
    process_index: int,
) -> None:
    batch_sampler: Any = dataloader.batch_sampler
    if batch_sampler is None and isinstance(dataloader.sampler, BatchSampler):
        # DataLoader(sampler=BatchSampler(...), batch_size=None): shard those batches.
        recipe.sampler_batches = True
        batch_sampler = dataloader.sampler
    elif batch_sampler is None:  # batch_size=None: every item is a batch
        recipe.unbatched = True
        batch_sampler = BatchSampler(dataloader.sampler, 1, False)
    sampler: Any = getattr(batch_sampler, "sampler", None)
    if _is_plain_shuffle(batch_sampler, sampler):
        distributed = num_processes > 1
        replacement = bool(getattr(sampler, "replacement", False))
        num_samples = getattr(sampler, "_num_samples", None)
        new: RandomSampler
        if isinstance(sampler, SeedableRandomSampler):
            new = recipe.random_sampler = sampler
        elif config.use_seedable_sampler:
            new = recipe.random_sampler = SeedableRandomSampler(
                sampler.data_source,
                replacement,
                num_samples,
                sampler.generator,
                data_seed=_seedable_seed(config, distributed),
            )
        else:
            new = recipe.recorded_sampler = RecordedRandomSampler(
                sampler.data_source,
                replacement,
                num_samples,
                _shared_generator(sampler, distributed),
            )
        batch_sampler = BatchSampler(new, batch_sampler.batch_size, batch_sampler.drop_last)
    shard = BatchSamplerShard(
        batch_sampler, num_processes, process_index, config.split_batches, config.even_batches
    )
    recipe.shard = shard
    bs = shard.batch_size
    global_bs = None if bs is None else (bs if config.split_batches else bs * num_processes)
    samples = len(sampler) if hasattr(sampler, "__len__") else recipe.total_dataset_length
    if recipe.unbatched:
        global_bs = None
    elif global_bs is not None and samples is not None and config.even_batches:
        recipe.remainder = 0 if shard.drop_last else samples % global_bs
    recipe.total_batch_size = global_bs


class SkipDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that drops the first ``skip_batches`` batches of every pass.

    Used by :func:`skip_first_batches` for unprepared loaders over iterable datasets, whose
    batches cannot be skipped without reading them.

    With ``use_stateful_dataloader=True`` the object is built on torchdata's
    ``StatefulDataLoader`` (it is an instance of both classes, as in Accelerate): its
    ``state_dict()`` is the ``StatefulDataLoader``'s, counting the dropped batches too, so a
    loader that loads it (skipping nothing) continues with the next batch.

    Args:
        dataset: the dataset.
        skip_batches: batches to drop at the start of every pass.
        use_stateful_dataloader: build on torchdata's ``StatefulDataLoader``.
        **kwargs: the ``DataLoader`` arguments.

    Raises:
        ImportError: for ``use_stateful_dataloader=True`` without torchdata (with the pip
            command that installs it).
    """

    def __new__(
        cls,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> Any:
        if use_stateful_dataloader and cls is SkipDataLoader:
            cls = _stateful_skip_class()
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader

    @property
    def base_dataloader(self) -> Any:
        """The loader that reads the data: this object itself (Accelerate's name)."""
        return self

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)


_STATEFUL_SKIP: type | None = None


def _stateful_skip_class() -> type:
    """``SkipDataLoader`` over torchdata's ``StatefulDataLoader`` (made on first use, so that
    importing accelkit does not import torchdata)."""
    global _STATEFUL_SKIP
    if _STATEFUL_SKIP is None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            raise DependencyError(
                "SkipDataLoader(use_stateful_dataloader=True) needs torchdata: "
                "pip install 'torchdata>=0.8'"
            ) from None
        _STATEFUL_SKIP = type(
            "StatefulSkipDataLoader",
            (SkipDataLoader, StatefulDataLoader),
            {
                "__doc__": "A :class:`SkipDataLoader` built on ``StatefulDataLoader``.",
                "__module__": __name__,
            },
        )
    return _STATEFUL_SKIP


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A dataloader over the same data that leaves out the first ``num_batches`` batches.

    For a prepared loader the result is prepared too (same shard, device, epoch, shuffling) and
    shares the original's position; the skipped batches of a map-style dataset are never loaded.
    Only its first pass skips, and that pass starts at batch ``num_batches`` of the epoch
    whether or not ``load_state`` restored a position (a restored position is replaced, never
    added to), so after ``load_state`` both the resume idiom of the Accelerate documents (this
    loader for the resumed epoch, the original for the following ones) and iterating the
    original alone give the batches of an uninterrupted run. (In the reference, the skipping
    loader skips on every pass.)

    Args:
        dataloader: a prepared or plain ``DataLoader``.
        num_batches: batches to leave out (per process).

    Raises:
        ValueError: for a negative ``num_batches``.
        TypeError: if ``dataloader`` is not a ``DataLoader``.
    """
    if num_batches < 0:
        raise ConfigurationError(f"num_batches={num_batches} must be >= 0.")
    if is_prepared(dataloader):
        return dataloader.skip_first_batches(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise WrongTypeError(
            f"skip_first_batches expects a DataLoader, got {type(dataloader).__name__}."
        )
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(
            dataloader.dataset,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            skip_batches=num_batches,
            **kwargs,
        )
    skipper = SkipBatchSampler(dataloader.batch_sampler, num_batches)  # type: ignore[arg-type]
    return DataLoader(dataloader.dataset, batch_sampler=skipper, **kwargs)
