"""Accelerate's ``accelerate.data_loader`` names, on accelkit's implementations.

``from accelerate.data_loader import X`` becomes ``from accelkit.data_loader import X`` with the
same signatures. What differs:

* :func:`prepare_data_loader` returns a prepared loader of :mod:`accelkit.data.prepared` (a
  ``DataLoader`` subclass); ``isinstance(loader, DataLoaderShard)`` is True for every prepared
  loader. ``rng_types`` is accepted and unused: processes shuffle alike through the sampler.
* device meshes (``torch_device_mesh``) are not supported and are refused with the fix;
  dispatching (``dispatch_batches=True``, :class:`DataLoaderDispatcher`) is supported (see
  :mod:`accelkit.data.dispatch`) except with ``use_stateful_dataloader``.
* a loader from :func:`skip_first_batches` skips on its first pass only (see
  :mod:`accelkit.data.prepared`).

``DataLoaderAdapter`` (the reference's wrapping base class) has no counterpart: prepared
loaders are ``DataLoader`` subclasses, not wrappers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from accelkit.data import preparation as _data
from accelkit.data import sampling as _sampling
from accelkit.data.preparation import SkipDataLoader, skip_first_batches
from accelkit.data.prepared import PreparedLoaderMixin, is_prepared
from accelkit.data.sampling import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
from accelkit.errors import ConfigurationError

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]

#: The behaviour every prepared loader has (``end_of_dataloader``, ``remainder``, ...).
DataLoaderStateMixin = PreparedLoaderMixin


def _refuse_mesh(torch_device_mesh: Any) -> None:
    if torch_device_mesh is not None:
        raise ConfigurationError(
            f"torch_device_mesh={torch_device_mesh!r} is not supported: accelkit shards data "
            "over all processes. Remove torch_device_mesh."
        )


def prepare_data_loader(
    dataloader: DataLoader[Any],
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[Any] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> Any:
    """Shard ``dataloader`` for one process (Accelerate's signature).

    Args:
        dataloader: the loader to shard.
        device: where ``put_on_device`` moves batches.
        num_processes: processes in the run (default: from the launcher's environment).
        process_index: this process's index (default: from the launcher's environment).
        split_batches: split each batch across processes.
        put_on_device: move batches to ``device``.
        rng_types: accepted for compatibility (processes shuffle alike through the sampler).
        dispatch_batches: read on the main process and send every process its slice (None:
            for an ``IterableDataset`` with ``put_on_device``).
        even_batches: pad the last round so every process gets as many batches.
        slice_fn_for_dispatch: with dispatching, takes a process's part of a batch.
        use_seedable_sampler: shuffle with a :class:`SeedableRandomSampler`.
        data_seed: its seed.
        non_blocking: asynchronous copies to the device.
        use_stateful_dataloader: build on torchdata's ``StatefulDataLoader``.
        torch_device_mesh: only ``None``.

    Returns:
        A prepared dataloader.

    Raises:
        ValueError: for ``dispatch_batches=True`` without ``put_on_device``, or a device mesh.
    """
    _refuse_mesh(torch_device_mesh)
    if dispatch_batches and not put_on_device:
        raise ConfigurationError(
            "dispatch_batches=True requires put_on_device=True (the main process broadcasts "
            "the batches on the device); pass put_on_device=True or dispatch_batches=False."
        )
    config = _data.DataLoaderConfiguration(
        split_batches=split_batches,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
    )
    if num_processes is None or process_index is None:
        from accelkit.runtime.state import PartialState

        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    return _data.prepare_data_loader(
        dataloader,
        num_processes=num_processes,
        process_index=process_index,
        device=device if put_on_device else None,
        config=config,
        slice_fn=slice_fn_for_dispatch,
    )


def get_sampler(dataloader: DataLoader[Any]) -> Any:
    """The sample-level sampler of ``dataloader`` (inside its batch sampler), or None."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


class _PreparedCheck(type):
    """``isinstance(x, DataLoaderShard)`` holds for every prepared dataloader."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return is_prepared(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return isinstance(subclass, type) and issubclass(subclass, PreparedLoaderMixin)


class DataLoaderShard(metaclass=_PreparedCheck):
    """A prepared dataloader over ``DataLoader(dataset, **kwargs)`` (Accelerate's signature).

    Like the reference's class, it does not shard by itself (pass a sharded ``batch_sampler``
    or use :func:`prepare_data_loader`); it moves batches to ``device`` and knows its end.
    Constructing it returns a prepared loader; every prepared loader is an instance.

    Raises:
        ValueError: for ``skip_batches`` over an ``IterableDataset`` or a device mesh.
    """

    def __new__(
        cls,
        dataset: Any,
        device: torch.device | None = None,
        rng_types: list[Any] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> Any:
        _refuse_mesh(torch_device_mesh)
        loader: DataLoader[Any] = DataLoader(dataset, **kwargs)
        if skip_batches:
            if isinstance(dataset, IterableDataset):
                raise ConfigurationError(
                    f"DataLoaderShard(skip_batches={skip_batches}) over an IterableDataset is "
                    "not supported; use skip_first_batches(loader, n) on the prepared loader."
                )
            skipper = SkipBatchSampler(loader.batch_sampler, skip_batches)  # type: ignore[arg-type]
            rest = {k: v for k, v in kwargs.items() if k not in _BATCHING}
            loader = DataLoader(dataset, batch_sampler=skipper, **rest)
        config = _data.DataLoaderConfiguration(
            use_stateful_dataloader=use_stateful_dataloader,
            non_blocking=_non_blocking,
        )
        prepared = _data.prepare_data_loader(loader, device=device, config=config)
        prepared.set_epoch(iteration)
        return prepared


_BATCHING = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class DataLoaderDispatcher(metaclass=_PreparedCheck):
    """A prepared loader over ``DataLoader(dataset, **kwargs)`` that the main process reads and
    dispatches (Accelerate's signature; see :mod:`accelkit.data.dispatch`).

    Constructing it returns a prepared loader (placed on the state's device). Like
    :class:`DataLoaderShard`, every prepared loader is an instance.

    Raises:
        ValueError: for ``skip_batches``, a stateful loader or a device mesh.
    """

    def __new__(
        cls,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Any = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> Any:
        from accelkit.runtime.state import PartialState

        _refuse_mesh(torch_device_mesh)
        if skip_batches:
            raise ConfigurationError(
                f"DataLoaderDispatcher(skip_batches={skip_batches}) is not supported; use "
                "skip_first_batches(loader, n) on the prepared loader."
            )
        state = PartialState()
        config = _data.DataLoaderConfiguration(
            split_batches=split_batches,
            dispatch_batches=True,
            non_blocking=_non_blocking,
            use_stateful_dataloader=use_stateful_dataloader,
        )
        prepared = _data.prepare_data_loader(
            DataLoader(dataset, **kwargs),
            num_processes=state.num_processes,
            process_index=state.process_index,
            device=state.device,
            config=config,
            slice_fn=slice_fn,
        )
        prepared.set_epoch(iteration)
        return prepared


class IterableDatasetShard(_sampling.IterableDatasetShard):
    """:class:`accelkit.data.sampling.IterableDatasetShard` with Accelerate's arguments.

    Args:
        dataset: the stream to shard.
        batch_size: the batch size of each process (of all processes with ``split_batches``).
        drop_last: drop the last, incomplete round instead of completing it.
        num_processes: processes in the run.
        process_index: this process's index.
        split_batches: ``batch_size`` is the global batch size.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        total = batch_size if split_batches else batch_size * num_processes
        super().__init__(dataset, total, num_processes, process_index, drop_last)
        self.split_batches = split_batches
