"""Prepared dataloaders: sharded across processes, placed on the device, resumable.

``accelkit.data`` is a public path: its names are those of :mod:`.preparation`. The room's
modules: :mod:`.preparation` (``prepare_data_loader``, ``DataLoaderConfiguration``,
``skip_first_batches``), :mod:`.prepared` (the prepared loader classes), :mod:`.position`
(where a pass is in its epoch's global order and shuffling, for a resume on any process count),
:mod:`.sampling` (samplers that shard), :mod:`.dispatch` (the main process reads, every process
gets its slice), :mod:`.batches` (nested batches: structure, slices, size) and
:mod:`.lookahead` (the sample indices a loader hands out next, without handing them out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr

__all__ = [
    "DataLoaderConfiguration",
    "PreparedDataLoader",
    "SkipDataLoader",
    "prepare_data_loader",
    "resolve_config",
    "skip_first_batches",
]

# Resolved on first use: importing one module of this room (``accelkit.data.<module>``) runs
# this file, and must not import what the room's heavier modules need (torch, for the
# command line's cheap commands).
__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "accelkit.data.preparation"))

if TYPE_CHECKING:
    from accelkit.data.preparation import (
        DataLoaderConfiguration,
        PreparedDataLoader,
        SkipDataLoader,
        prepare_data_loader,
        resolve_config,
        skip_first_batches,
    )
