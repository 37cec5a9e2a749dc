"""Dispatching: the main process reads the data and sends each process its slice.

With ``DataLoaderConfiguration(dispatch_batches=True)`` (Accelerate's ``DataLoaderDispatcher``
semantics) only process 0 iterates the user's dataloader. Each round it reads one batch (with
``split_batches``) or ``num_processes`` batches concatenated (without), broadcasts the batch's
structure (:func:`~accelkit.utils.operations.get_data_structure`) with
``broadcast_object_list`` and then its tensors with ``broadcast`` on the default process group,
and every process keeps its slice ``[i * b, (i + 1) * b)`` where ``b`` is the round's size
divided by the number of processes.

A last round whose size does not divide by the number of processes is completed with the first
``num_processes`` samples of the epoch (unless the loader has ``drop_last``), and the loader's
``remainder`` is the last round's real size, so ``gather_for_metrics`` drops the padding. Only
tensors (in nested lists, tuples and dicts) can be dispatched.

This is the mechanism; :mod:`accelkit.data.prepared` drives it (look-ahead, end of the loader,
position) as for every prepared loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accelkit.data.batches import (
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    slice_tensors,
)
from accelkit.errors import UsageError
from accelkit.runtime import ops

__all__ = ["Dispatch", "dispatched_batches"]

SliceFn = Callable[..., Any]


@dataclasses.dataclass
class Dispatch:
    """How a prepared loader dispatches (part of its picklable recipe).

    Args:
        num_processes: processes in the run.
        process_index: this process's index (0 reads the data).
        split_batches: one batch of the user's loader per round (split across processes)
            instead of ``num_processes`` of them.
        drop_last: the user's loader drops incomplete batches: an incomplete last round is
            dropped too instead of being completed.
        device: where batches go before the broadcast (the default group's device).
        non_blocking: asynchronous copies to ``device``.
        slice_fn: ``slice_fn(batch, slice, process_index=, num_processes=)`` taking a
            process's part of a batch (default: :func:`~accelkit.utils.slice_tensors`).
    """

    num_processes: int
    process_index: int
    split_batches: bool
    drop_last: bool
    device: torch.device | None
    non_blocking: bool = False
    slice_fn: SliceFn | None = None

    def length(self, base_length: int) -> int:
        """Batches per process per pass, given the user's loader's ``base_length``."""
        if self.split_batches:
            return base_length
        if self.drop_last:
            return base_length // self.num_processes
        return -(-base_length // self.num_processes)


def _read_round(iterator: Iterator[Any] | None, dispatch: Dispatch) -> Any:
    """On the main process: the next round's batch (None at the end)."""
    assert iterator is not None
    wanted = 1 if dispatch.split_batches else dispatch.num_processes
    batches = []
    for _ in range(wanted):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    if not batches or (len(batches) < wanted and dispatch.drop_last):
        return None
    if len(batches) == 1:
        return batches[0]
    try:
        return ops.concatenate(batches, dim=0)
    except (RuntimeError, TypeError) as error:
        raise UsageError(
            f"dispatch_batches=True cannot concatenate {len(batches)} batches of the "
            f"dataloader into one round ({error}); batches must be tensors (in lists, tuples "
            "or dicts) of the same shape but for the first dimension. Pass "
            "DataLoaderConfiguration(split_batches=True) so that the main process reads one "
            "batch per round, or dispatch_batches=False so that every process reads its own."
        ) from error


def dispatched_batches(
    base: Iterator[Any] | None,
    dispatch: Dispatch,
    on_round: Callable[[int], None],
) -> Iterator[Any]:
    """This process's slices of the rounds the main process reads from ``base``.

    Every process must iterate this in step (it makes collective calls). ``base`` is only read
    on process 0. ``on_round(size)`` is called with each round's real global size before its
    slice is yielded (the prepared loader keeps the last one as its ``remainder``).
    """
    n, rank = dispatch.num_processes, dispatch.process_index
    if n == 1:
        # Nothing to send: the batches as they are, non-tensor values included (as Accelerate).
        yield from _undispatched(base, dispatch, on_round)
        return
    slice_fn = dispatch.slice_fn or slice_tensors
    first: Any = None
    while True:
        batch = _read_round(base, dispatch) if rank == 0 else None
        info = [None if batch is None else get_data_structure(batch)]
        ops.broadcast_object_list(info)
        if info[0] is None:
            return
        if rank != 0:
            batch = initialize_tensors(info[0])
        if dispatch.device is not None:
            batch = ops.send_to_device(batch, dispatch.device, dispatch.non_blocking)
        batch = ops.broadcast(batch, from_process=0)
        size = find_batch_size(batch)
        if first is None and not dispatch.drop_last:
            first = slice_fn(batch, slice(0, n), process_index=rank, num_processes=n)
        share = size // n
        if size % n and first is not None:
            # An incomplete last round: complete it from the start of the epoch.
            batch = ops.concatenate([batch, first], dim=0)
            share += 1
        on_round(size)
        part = slice(rank * share, (rank + 1) * share)
        yield slice_fn(batch, part, process_index=rank, num_processes=n)


def _undispatched(
    base: Iterator[Any] | None, dispatch: Dispatch, on_round: Callable[[int], None]
) -> Iterator[Any]:
    """One process's rounds: the user's batches, placed on the device."""
    while (batch := _read_round(base, dispatch)) is not None:
        if dispatch.device is not None:
            batch = ops.send_to_device(batch, dispatch.device, dispatch.non_blocking)
        try:
            on_round(find_batch_size(batch))
        except ValueError:  # no tensor in the batch: its size is unknown
            pass
        yield batch
