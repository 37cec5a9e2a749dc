"""Read-only settings of the :class:`~accelkit.Accelerator` that scripts written for the reference
read (``accelerator.split_batches``, ``accelerator.log_with``, ...), and :meth:`Settings.profile`.

Each property reads a configuration object the accelerator was built with; none of them changes
behaviour.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import accelkit.training.kwargs_handlers as _handlers
import accelkit.training.profiling as _profiling
from accelkit.runtime.state import DistributedType
from accelkit.training.kwargs_handlers import find as _find_handler

if TYPE_CHECKING:
    import torch

    from accelkit.data.preparation import DataLoaderConfiguration
    from accelkit.runtime.state import AcceleratorState
    from accelkit.training.kwargs_handlers import KwargsHandler

__all__ = ["Settings"]


class Settings:
    """The reference's settings views (see the ``Accelerator`` properties of the same names).

    Args:
        state: the process state.
        dataloader_config: the accelerator's dataloader configuration (shared: ``even_batches``
            writes to it).
        kwargs_handlers: the handlers given to ``Accelerator(kwargs_handlers=...)``.
        log_with: ``Accelerator(log_with=...)`` as given.
    """

    def __init__(
        self,
        state: AcceleratorState,
        dataloader_config: DataLoaderConfiguration,
        kwargs_handlers: list[KwargsHandler],
        log_with: Any,
    ) -> None:
        self.state = state
        self.dataloader_config = dataloader_config
        self.kwargs_handlers = kwargs_handlers
        self.mixed_precision = state.mixed_precision
        self.requested_log_with = log_with

    @property
    def ddp_handler(self) -> _handlers.DistributedDataParallelKwargs | None:
        """The ``DistributedDataParallelKwargs`` given in ``kwargs_handlers`` (or None)."""
        found: _handlers.DistributedDataParallelKwargs | None = _find_handler(
            self.kwargs_handlers, _handlers.DistributedDataParallelKwargs
        )
        return found

    @property
    def scaler_handler(self) -> _handlers.GradScalerKwargs | None:
        """The ``GradScalerKwargs`` given in ``kwargs_handlers`` (or None)."""
        found: _handlers.GradScalerKwargs | None = _find_handler(
            self.kwargs_handlers, _handlers.GradScalerKwargs
        )
        return found

    @property
    def init_handler(self) -> _handlers.InitProcessGroupKwargs | None:
        """The ``InitProcessGroupKwargs`` given in ``kwargs_handlers`` (or None)."""
        found: _handlers.InitProcessGroupKwargs | None = _find_handler(
            self.kwargs_handlers, _handlers.InitProcessGroupKwargs
        )
        return found

    @property
    def autocast_handler(self) -> _handlers.AutocastKwargs | None:
        """The ``AutocastKwargs`` given in ``kwargs_handlers`` (or None)."""
        found: _handlers.AutocastKwargs | None = _find_handler(
            self.kwargs_handlers, _handlers.AutocastKwargs
        )
        return found

    @property
    def profile_handler(self) -> _profiling.ProfileKwargs | None:
        """The ``ProfileKwargs`` given in ``kwargs_handlers`` (or None)."""
        found: _profiling.ProfileKwargs | None = _find_handler(
            self.kwargs_handlers, _profiling.ProfileKwargs
        )
        return found

    @property
    def split_batches(self) -> bool:
        """Whether each batch is split across processes (``DataLoaderConfiguration``)."""
        return bool(self.dataloader_config.split_batches)

    @property
    def even_batches(self) -> bool:
        """Whether every process gets the same number of batches."""
        return bool(self.dataloader_config.even_batches)

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def dispatch_batches(self) -> bool | None:
        """Whether the main process reads and dispatches batches (None: for iterable datasets)."""
        return self.dataloader_config.dispatch_batches

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared dataloaders are torchdata ``StatefulDataLoader`` s."""
        return bool(self.dataloader_config.use_stateful_dataloader)

    @property
    def use_seedable_sampler(self) -> bool:
        """The ``DataLoaderConfiguration.use_seedable_sampler`` setting."""
        return bool(self.dataloader_config.use_seedable_sampler)

    @property
    def non_blocking(self) -> bool:
        """Whether batches are copied to the device asynchronously."""
        return bool(self.dataloader_config.non_blocking)

    @property
    def log_with(self) -> list[Any]:
        """The trackers asked for in ``Accelerator(log_with=...)``, as a list."""
        value = self.requested_log_with
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    @property
    def native_amp(self) -> bool:
        """Whether ``torch.autocast`` mixed precision is on."""
        return self.mixed_precision in ("fp16", "bf16")

    @property
    def use_fp16(self) -> bool:
        """Whether ``mixed_precision`` is ``"fp16"``."""
        return self.mixed_precision == "fp16"

    @property
    def multi_device(self) -> bool:
        """Whether several GPUs take part (``MULTI_GPU``)."""
        return bool(
            self.state.use_distributed and self.state.distributed_type == DistributedType.MULTI_GPU
        )

    def profile(
        self, profile_handler: _profiling.ProfileKwargs | None = None
    ) -> contextlib.AbstractContextManager[torch.profiler.profile]:
        """Profile the block with ``torch.profiler`` (see :mod:`accelkit.training.profiling`).

        Args:
            profile_handler: settings overriding the ``ProfileKwargs`` given in
                ``Accelerator(kwargs_handlers=[...])``.

        Example:
            >>> with accelerator.profile() as prof:
            ...     train()
            >>> accelerator.print(prof.key_averages().table())
        """
        handler = profile_handler or _find_handler(self.kwargs_handlers, _profiling.ProfileKwargs)
        return _profiling.profile(handler, self.state.process_index)
