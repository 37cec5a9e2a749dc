"""The process part of the :class:`~accelkit.Accelerator`: who this process is, how it waits for
the others, and the collectives.

Split from ``accelerator.py`` along the seam between the process and the training loop: every
member reads the :class:`~accelkit.runtime.state.AcceleratorState` it was built with or calls
:mod:`accelkit.runtime.ops`, and nothing here knows about models, optimizers or checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

import accelkit.runtime.ops as ops
from accelkit.runtime.state import AcceleratorState, DistributedType

__all__ = ["Processes"]


class Processes:
    """Process control and collectives: the implementation of the ``Accelerator`` methods of the
    same names (their documentation is this class's), and what the process state alone cannot
    answer (the distributed type once FSDP is on, the cross-process trigger flag).

    Args:
        state: the process state.
        sharded: whether ``prepare`` shards models with FSDP (the distributed type is then
            ``FSDP`` whatever the launcher said).
    """

    def __init__(self, state: AcceleratorState, sharded: bool) -> None:
        self.state = state
        self.sharded = sharded
        self._trigger = torch.tensor(0, device=state.device)

    @property
    def distributed_type(self) -> DistributedType:
        """How processes are connected (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``)."""
        return DistributedType.FSDP if self.sharded else self.state.distributed_type

    @property
    def joined_by_ddp(self) -> bool:
        """Whether prepared models are wrapped in ``DistributedDataParallel``."""
        return self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    def set_trigger(self) -> None:
        """Raise a flag on this process; :meth:`check_trigger` sees it on every process."""
        self._trigger.fill_(1)

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger`; then resets it."""
        if ops.reduce(self._trigger, reduction="sum").item() > 0:
            self._trigger.fill_(0)
            return True
        return False

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine."""
        self.state.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Context manager: the main process runs the block first, then the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Context manager: each machine's main process runs the block first."""
        return self.state.local_main_process_first()

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: run only on the main process."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: run only on each machine's main process."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: run only on the last process."""
        return self.state.on_last_process(function)

    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Any:
        """Decorator: run only on the process of global index ``process_index``."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: run only on the process of local index ``local_process_index``."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """Context manager yielding this process's share of ``inputs``."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or a nested structure of tensors) from all processes."""
        return ops.gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce across processes: ``"sum"``, ``"mean"`` or ``"none"``."""
        return ops.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors on ``dim`` to the largest size across processes, so they can be gathered."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)
