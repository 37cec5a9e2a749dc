"""Prepared dataloaders: sharded across processes, placed on the device, resumable.

:func:`prepare_data_loader` turns a user's ``DataLoader`` into a :class:`PreparedDataLoader` (a
``DataLoader`` subclass, or a torchdata ``StatefulDataLoader`` subclass with
``use_stateful_dataloader=True``) that

* gives each process its share of every epoch (see :mod:`accelkit.sampling`): every sample is
  seen once per epoch across processes, and with ``even_batches`` every process gets the same
  number of full batches (the last round is padded by wrapping around);
* shuffles identically on every process: a ``RandomSampler`` becomes a
  :class:`~accelkit.sampling.SeedableRandomSampler` seeded from the main process and advanced
  one epoch per full pass (or by :meth:`PreparedDataLoader.set_epoch`);
* moves each batch to the device;
* looks one batch ahead so it knows, while the last batch is being used, that it is the last
  one (gradient accumulation synchronises there; ``gather_for_metrics`` drops the padding);
* reports and restores its position with ``state_dict()``/``load_state_dict()``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accelkit import ops
from accelkit.optim import GradientState
from accelkit.sampling import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
)

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
        even_batches: give every process the same number of batches by completing the last
            round with samples from the start of the epoch. With False, processes may get
            different numbers of batches (use ``join_uneven_inputs`` when training).
        use_stateful_dataloader: build on torchdata's ``StatefulDataLoader`` so that
            ``state_dict()`` also captures worker and dataset state.
        non_blocking: copy batches to the device asynchronously (useful with
            ``pin_memory=True``).
        data_seed: the shuffling seed (default: the main process's ``torch.initial_seed()``,
            which ``set_seed`` sets).
        use_seedable_sampler: accepted for compatibility with the reference; shuffling is always
            seeded (``seed + epoch``) here, so every process draws the same order.
        dispatch_batches: only ``None``/``False`` (every process reads its own share); fetching
            on the main process and scattering is not supported.

    Raises:
        ValueError: for ``dispatch_batches=True``.
    """

    split_batches: bool = False
    even_batches: bool = True
    use_stateful_dataloader: bool = False
    non_blocking: bool = False
    data_seed: int | None = None
    use_seedable_sampler: bool = True
    dispatch_batches: bool | None = None

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise ValueError(
                "DataLoaderConfiguration(dispatch_batches=True) is not supported: every process "
                "reads its own share of the data. Remove dispatch_batches (or set it to False)."
            )


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
        raise TypeError(
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


class _Position:
    """Where a loader is in its data; shared with the loaders ``skip_first_batches`` makes."""

    __slots__ = ("end", "epoch", "snapshot", "yielded")

    def __init__(self) -> None:
        self.epoch = 0
        self.yielded = 0
        self.end = False
        self.snapshot: dict[str, Any] | None = None


class _PreparedMixin:
    """The behaviour shared by the plain and the stateful prepared dataloader."""

    # Set by _setup; declared for type checkers.
    gradient_state: GradientState
    device: torch.device | None
    remainder: int

    def _setup(
        self,
        *,
        gradient_state: GradientState,
        device: torch.device | None,
        non_blocking: bool,
        shard: BatchSamplerShard | None,
        iterable_shard: IterableDatasetShard | None,
        random_sampler: SeedableRandomSampler | None,
        remainder: int,
        total_batch_size: int | None,
        total_dataset_length: int | None,
        stateful: bool,
        rebuild: Callable[[int], Any],
        worker_seed: int | None = None,
    ) -> None:
        self.gradient_state = gradient_state
        self._worker_seed = worker_seed
        self.device = device
        self.non_blocking = non_blocking
        self._shard = shard
        self._iterable_shard = iterable_shard
        self._random_sampler = random_sampler
        self.remainder = remainder
        self._static_remainder = remainder
        self.total_batch_size = total_batch_size
        self.total_dataset_length = total_dataset_length
        self._stateful = stateful
        self._rebuild = rebuild
        self._pos = _Position()
        self._skip_always = 0  # batches read and dropped (iterable datasets only)
        self._skip_once = 0
        # The device copy is decided once here, not per batch.
        self._move: Callable[[Any], Any] | None = None
        if device is not None and device.type != "cpu":
            self._move = lambda batch: ops.send_to_device(batch, device, non_blocking)

    # ---------------------------------------------------------------- epochs

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the current pass is in use."""
        return self._pos.end

    @property
    def epoch(self) -> int:
        """The epoch whose order the next (or current) pass uses; +1 after each full pass."""
        return self._pos.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffling order (and dataset epoch) of ``epoch`` from the next pass on."""
        self._pos.epoch = int(epoch)

    def _skipped_always(self) -> int:
        return self._shard.skip_batches if self._shard is not None else self._skip_always

    def _begin(self) -> int:
        """Prepare a pass; return how many batches ``__iter__`` must read and drop."""
        pos = self._pos
        if self._worker_seed is not None:
            self.generator.manual_seed(self._worker_seed + pos.epoch)  # type: ignore[attr-defined]
        if self._random_sampler is not None:
            self._random_sampler.set_epoch(pos.epoch)
        if self._iterable_shard is not None:
            self._iterable_shard.set_epoch(pos.epoch)
        resume = self._skip_once
        self._skip_once = 0
        pos.yielded = self._skipped_always() + resume
        pos.end = False
        self.remainder = self._static_remainder
        if self._stateful:  # StatefulDataLoader fast-forwards itself
            resume = 0
        elif self._shard is not None:  # skip indices, without loading the samples
            self._shard.skip_once = resume
            resume = 0
        return resume + self._skip_always

    def __iter__(self) -> Iterator[Any]:
        drop = self._begin()
        pos = self._pos
        state = self.gradient_state
        state.enter_loader(self)
        try:
            it = super().__iter__()  # type: ignore[misc]
            for _ in range(drop):
                if next(it, _END) is _END:
                    break
            current = next(it, _END)
            move = self._move
            if current is not _END and move is not None:
                current = move(current)
            while current is not _END:
                snapshot = self._inner_state() if self._stateful else None
                upcoming = next(it, _END)
                if upcoming is _END:
                    self._mark_end()
                else:
                    pos.snapshot = snapshot
                    if move is not None:
                        upcoming = move(upcoming)
                pos.yielded += 1
                yield current
                current = upcoming
            pos.epoch += 1
            pos.yielded = 0
            pos.end = False
        finally:
            state.exit_loader(self)

    def _mark_end(self) -> None:
        self._pos.end = True
        shard = self._iterable_shard
        if (
            shard is not None
            and shard.last_remainder >= 0
            and self.total_batch_size is not None
            and getattr(self, "num_workers", 0) == 0
        ):
            self.remainder = shard.last_remainder
        if self._stateful:
            self._pos.snapshot = self._inner_state()

    def _inner_state(self) -> dict[str, Any]:
        return dict(super().state_dict())  # type: ignore[misc]

    # ------------------------------------------------------------- position

    def state_dict(self) -> dict[str, Any]:
        """This process's position: epoch, batches yielded, shuffling seed.

        Saved while the last batch of an epoch is in use, it points at the start of the next
        epoch. With ``use_stateful_dataloader`` it also holds the ``StatefulDataLoader`` state
        (under ``"stateful_dataloader"``), which may differ between processes.
        """
        pos = self._pos
        out: dict[str, Any] = {
            "epoch": pos.epoch + 1 if pos.end else pos.epoch,
            "batches_yielded": 0 if pos.end else pos.yielded,
            "seed": None if self._random_sampler is None else self._random_sampler.seed,
        }
        if self._stateful:
            snapshot = pos.snapshot
            out["stateful_dataloader"] = snapshot if snapshot is not None else self._inner_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the position ``state_dict`` describes, on the next pass.

        Raises:
            KeyError: naming the missing entry when ``state_dict`` is not one of ours.
        """
        for key in ("epoch", "batches_yielded"):
            if key not in state_dict:
                raise KeyError(
                    f"dataloader state has no {key!r} entry (keys: {sorted(state_dict)}); pass "
                    "a dict produced by a prepared dataloader's state_dict()."
                )
        self._pos.epoch = int(state_dict["epoch"])
        seed = state_dict.get("seed")
        if seed is not None and self._random_sampler is not None:
            self._random_sampler.seed = int(seed)
        self._skip_once = max(0, int(state_dict["batches_yielded"]) - self._skipped_always())
        inner = state_dict.get("stateful_dataloader")
        if self._stateful and inner is not None:
            super().load_state_dict(inner)  # type: ignore[misc]
            self._pos.snapshot = inner

    # ------------------------------------------------------------- skipping

    def skip_first_batches(self, num_batches: int) -> Any:
        """A new prepared loader over the same data that leaves out the first ``num_batches``.

        It shares this loader's position: its progress shows in this loader's ``state_dict()``
        and its full pass advances this loader's epoch.
        """
        clone = self._rebuild(num_batches)
        clone._pos = self._pos
        return clone


_END = object()


class PreparedDataLoader(_PreparedMixin, DataLoader[Any]):  # type: ignore[misc]
    """A ``DataLoader`` made by :func:`prepare_data_loader` (see the module docstring).

    Extra attributes: ``device``, ``epoch``, ``end_of_dataloader``, ``remainder`` (real samples
    in the last global batch; -1 when unknown), ``total_batch_size`` (samples per step across
    processes), ``total_dataset_length``.
    """


_STATEFUL_CLASS: type | None = None


def _stateful_class() -> type:
    global _STATEFUL_CLASS
    if _STATEFUL_CLASS is None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            raise ImportError(
                "use_stateful_dataloader=True needs torchdata: pip install 'torchdata>=0.8'"
            ) from None
        _STATEFUL_CLASS = type(
            "PreparedStatefulDataLoader",
            (_PreparedMixin, StatefulDataLoader),
            {"__doc__": "A prepared dataloader built on torchdata's ``StatefulDataLoader``."},
        )
    return _STATEFUL_CLASS


def _is_stateful(loader: Any) -> bool:
    module = sys.modules.get(_STATEFUL_MODULE)
    return module is not None and isinstance(loader, module.StatefulDataLoader)


def _is_plain_shuffle(batch_sampler: Any, sampler: Any) -> bool:
    """Whether the loader is ``shuffle=True`` with PyTorch's (or torchdata's) own samplers.

    Only then is the sampler swapped for a :class:`SeedableRandomSampler`; custom samplers are
    kept as they are and must shuffle identically on every process themselves.
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


def _sync_seed(loader: DataLoader[Any], config: DataLoaderConfiguration, distributed: bool) -> int:
    if config.data_seed is not None:
        return int(config.data_seed)
    generator = getattr(loader.sampler, "generator", None) or loader.generator
    seed = int(generator.initial_seed() if generator is not None else torch.initial_seed())
    if distributed:
        seed = int(ops.broadcast_object_list([seed])[0])
    return seed


def prepare_data_loader(
    dataloader: DataLoader[Any],
    *,
    num_processes: int = 1,
    process_index: int = 0,
    device: torch.device | None = None,
    config: DataLoaderConfiguration | None = None,
    gradient_state: GradientState | None = None,
) -> Any:
    """Shard ``dataloader`` for this process (see the module docstring).

    Args:
        dataloader: the user's dataloader (a prepared one is returned as it is).
        num_processes: processes in the run.
        process_index: this process's index.
        device: where batches go (None: leave them where the collate function put them).
        config: sharding options.
        gradient_state: the accelerator's shared state (a private one if None).

    Returns:
        A :class:`PreparedDataLoader` (or its ``StatefulDataLoader`` variant).

    Raises:
        TypeError: if ``dataloader`` is not a ``DataLoader``.
        ValueError: for ``split_batches`` with a batch size not divisible by ``num_processes``.
    """
    if isinstance(dataloader, _PreparedMixin):
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"prepare_data_loader expects a torch.utils.data.DataLoader, got "
            f"{type(dataloader).__name__}. Wrap a dataset as DataLoader(dataset, batch_size=...)."
        )
    config = config or DataLoaderConfiguration()
    state = gradient_state or GradientState()
    stateful = config.use_stateful_dataloader or _is_stateful(dataloader)
    cls: type = _stateful_class() if stateful else PreparedDataLoader
    kwargs = _loader_kwargs(dataloader)
    # Every new iterator draws a worker base seed from the loader's generator, or from the
    # global torch RNG when it has none. That draw would shift every later random number
    # (dropout, ...) between a run and its mid-epoch resume, which creates the iterator after
    # load_state restored the RNG. A private generator, reseeded per epoch, leaves the global
    # stream alone and keeps worker seeds reproducible.
    worker_seed: int | None = None
    if kwargs["generator"] is None:
        kwargs["generator"] = torch.Generator()
        worker_seed = torch.initial_seed()
    dataset = dataloader.dataset
    common = {
        "gradient_state": state,
        "device": device,
        "non_blocking": config.non_blocking and dataloader.pin_memory,
        "stateful": stateful,
        "worker_seed": worker_seed,
    }
    try:
        length: int | None = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None

    if isinstance(dataset, IterableDataset):
        bs = dataloader.batch_size
        if bs is None and config.split_batches:
            raise ValueError(
                "split_batches=True cannot split the items of a DataLoader with batch_size=None "
                "(each item is already a batch); use split_batches=False."
            )
        # batch_size=None: every item is a batch; deal the items out one per process.
        total = num_processes if bs is None else bs if config.split_batches else bs * num_processes
        shard = IterableDatasetShard(
            dataset, total, num_processes, process_index, dataloader.drop_last, config.even_batches
        )
        remainder = -1
        if bs is not None and length is not None and not dataloader.drop_last:
            remainder = length % total if config.even_batches else -1

        def build_iterable(skip: int) -> Any:
            per_process = None if bs is None else total // num_processes
            loader = cls(shard, batch_size=per_process, drop_last=dataloader.drop_last, **kwargs)
            loader._setup(
                shard=None,
                iterable_shard=shard,
                random_sampler=None,
                remainder=remainder,
                total_batch_size=None if bs is None else total,
                total_dataset_length=length,
                rebuild=build_iterable,
                **common,
            )
            loader._skip_always = skip
            return loader

        return build_iterable(0)

    batch_sampler: Any = dataloader.batch_sampler
    unbatched = batch_sampler is None  # batch_size=None: every item is a batch
    if unbatched:
        batch_sampler = BatchSampler(dataloader.sampler, 1, False)
    random_sampler: SeedableRandomSampler | None = None
    sampler: Any = getattr(batch_sampler, "sampler", None)
    if _is_plain_shuffle(batch_sampler, sampler):
        if isinstance(sampler, SeedableRandomSampler):
            random_sampler = sampler
        else:
            seed = _sync_seed(dataloader, config, num_processes > 1)
            random_sampler = SeedableRandomSampler(
                sampler.data_source,
                seed,
                bool(getattr(sampler, "replacement", False)),
                getattr(sampler, "_num_samples", None),
            )
        batch_sampler = BatchSampler(
            random_sampler,
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
    base_shard = BatchSamplerShard(
        batch_sampler, num_processes, process_index, config.split_batches, config.even_batches
    )
    bs = base_shard.batch_size
    global_bs = None if bs is None else (bs if config.split_batches else bs * num_processes)
    samples = len(sampler) if hasattr(sampler, "__len__") else length
    remainder = -1
    if unbatched:
        global_bs = None
    elif global_bs is not None and samples is not None and config.even_batches:
        remainder = 0 if base_shard.drop_last else samples % global_bs

    def build_map(skip: int) -> Any:
        shard = base_shard.with_skip(skip) if skip else base_shard
        if unbatched:
            loader = cls(dataset, batch_size=None, sampler=_Unbatch(shard), **kwargs)
        else:
            loader = cls(dataset, batch_sampler=shard, **kwargs)
        loader._setup(
            shard=shard,
            iterable_shard=None,
            random_sampler=random_sampler,
            remainder=remainder,
            total_batch_size=global_bs,
            total_dataset_length=length,
            rebuild=build_map,
            **common,
        )
        return loader

    return build_map(0)


class _Unbatch(torch.utils.data.Sampler[int]):
    """Indices from a shard of one-index batches (for loaders with ``batch_size=None``)."""

    def __init__(self, shard: BatchSamplerShard) -> None:
        self.shard = shard

    def __iter__(self) -> Iterator[int]:
        for batch in self.shard:
            yield batch[0]

    def __len__(self) -> int:
        return len(self.shard)


class SkipDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that drops the first ``skip_batches`` batches of every pass.

    Used by :func:`skip_first_batches` for unprepared loaders over iterable datasets, whose
    batches cannot be skipped without reading them.
    """

    def __init__(self, *args: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                yield batch


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A dataloader over the same data that leaves out the first ``num_batches`` batches.

    For a prepared loader the result is prepared too (same shard, device, epoch, shuffling); the
    skipped batches of a map-style dataset are never loaded. Use it for the epoch you resume in
    and the original loader for the following epochs.

    Args:
        dataloader: a prepared or plain ``DataLoader``.
        num_batches: batches to leave out (per process).

    Raises:
        ValueError: for a negative ``num_batches``.
        TypeError: if ``dataloader`` is not a ``DataLoader``.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches={num_batches} must be >= 0.")
    if isinstance(dataloader, _PreparedMixin):
        return dataloader.skip_first_batches(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
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
