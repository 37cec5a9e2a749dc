"""Prepared dataloaders: sharded across processes, placed on the device, resumable.

``accelkit.data`` is a public path: its names are those of :mod:`.preparation`. The room's
modules: :mod:`.preparation` (``prepare_data_loader``, ``DataLoaderConfiguration``,
``skip_first_batches``), :mod:`.prepared` (the prepared loader classes), :mod:`.sampling`
(samplers that shard), :mod:`.dispatch` (the main process reads, every process gets its slice)
and :mod:`.batches` (nested batches: structure, slices, size).
"""

from accelkit.data.preparation import (
    DataLoaderConfiguration,
    PreparedDataLoader,
    SkipDataLoader,
    prepare_data_loader,
    resolve_config,
    skip_first_batches,
)

__all__ = [
    "DataLoaderConfiguration",
    "PreparedDataLoader",
    "SkipDataLoader",
    "prepare_data_loader",
    "resolve_config",
    "skip_first_batches",
]
