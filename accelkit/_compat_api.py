"""Read-only settings of the :class:`~accelkit.Accelerator` that scripts written for the reference
read (``accelerator.split_batches``, ``accelerator.log_with``, ...), and :meth:`profile`.

Split from ``accelerator.py``: each property reads a configuration object the accelerator
already holds; none of them changes behaviour.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accelkit import profiling as _profiling
from accelkit.dynamo import TorchDynamoPlugin
from accelkit.kwargs_handlers import find as _find_handler
from accelkit.state import AcceleratorState, DistributedType

__all__ = ["CompatAPI"]


class CompatAPI:
    """Settings views of the reference; mixed into the ``Accelerator``."""

    # Set by Accelerator.__init__.
    state: AcceleratorState
    dataloader_config: Any
    kwargs_handlers: list[Any]
    mixed_precision: str
    dynamo_plugin: TorchDynamoPlugin
    _log_with: Any

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
        value = self._log_with
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
    def deepspeed_plugin(self) -> None:
        """Always None: DeepSpeed is out of accelkit's scope."""
        return None

    @property
    def is_fsdp2(self) -> bool:
        """True when models are sharded with FSDP (always FSDP2 in accelkit)."""
        return bool(self.state.distributed_type == DistributedType.FSDP) or (
            getattr(self, "_fsdp", None) is not None
        )

    @property
    def multi_device(self) -> bool:
        """Whether several GPUs take part (``MULTI_GPU``)."""
        return self.state.use_distributed and self.state.distributed_type in (
            DistributedType.MULTI_GPU,
        )

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files (always True: saves are collective and the
        checkpoint layer picks the writer)."""
        return True

    @property
    def torch_device_mesh(self) -> None:
        """Always None: no ``ParallelismConfig`` device mesh (tensor/context parallelism is out
        of scope; FSDP builds its own mesh)."""
        return None

    @property
    def parallelism_config(self) -> None:
        """Always None: ``ParallelismConfig`` is out of accelkit's scope."""
        return None

    @property
    def fp8_backend(self) -> None:
        """Always None: FP8 training is out of accelkit's scope."""
        return None

    def profile(
        self, profile_handler: _profiling.ProfileKwargs | None = None
    ) -> contextlib.AbstractContextManager[torch.profiler.profile]:
        """Profile the block with ``torch.profiler`` (see :mod:`accelkit.profiling`).

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
