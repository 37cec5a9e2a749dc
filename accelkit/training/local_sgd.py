"""Local SGD: every process steps on its own gradients and the model parameters are averaged
across processes every ``local_sgd_steps`` optimizer steps.

Accelerate's ``accelerate.local_sgd.LocalSGD`` API (its face is :mod:`accelkit.local_sgd`)::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            with accelerator.accumulate(model):
                ...
                optimizer.step()
                local_sgd.step()

Inside the block the DDP model does not all-reduce gradients (``no_sync``); ``step()`` counts
optimizer steps and averages the parameters on every ``local_sgd_steps``-th; leaving the block
averages them once more, so every process ends with the same parameters. On one process (or
with ``enabled=False``) it does nothing.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from accelkit.errors import ConfigurationError
from accelkit.runtime.state import DistributedType

__all__ = ["LocalSGD"]

#: The process layouts where local SGD runs (DDP over torch.distributed, or one process).
_SUPPORTED = frozenset({DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU})


class LocalSGD:
    """Average the model's parameters across processes every ``local_sgd_steps`` steps.

    A context manager: see the module docstring for the loop it wraps.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model (DDP on several processes).
        local_sgd_steps: optimizer steps between two averagings (a positive integer).
        enabled: False turns every method into a no-op (as does running on one process).

    Attributes:
        num_steps: calls of :meth:`step` so far.
        enabled: whether averaging happens (``enabled`` and more than one process).

    Raises:
        NotImplementedError: for a process layout other than one process or DDP (FSDP,
            DeepSpeed, ...), naming it. Unlike Accelerate's, ``enabled=False`` is accepted on
            any layout (it does nothing), so a script can switch local SGD off under FSDP.
        ValueError: for a ``local_sgd_steps`` that is not a positive integer.
    """

    def __init__(
        self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        kind = accelerator.distributed_type
        if enabled and kind not in _SUPPORTED:
            raise NotImplementedError(
                f"LocalSGD runs on one process or on DDP (MULTI_CPU, MULTI_GPU); this run is "
                f"{getattr(kind, 'value', kind)}. Use plain data-parallel training there, or "
                "LocalSGD(..., enabled=False)."
            )
        if enabled and (
            isinstance(local_sgd_steps, bool)
            or not isinstance(local_sgd_steps, int)
            or local_sgd_steps < 1
        ):
            raise ConfigurationError(
                f"local_sgd_steps={local_sgd_steps!r} must be a positive integer (optimizer "
                "steps between two averagings of the parameters), e.g. local_sgd_steps=8."
            )
        self.enabled = bool(enabled) and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            no_sync = getattr(self.model, "no_sync", None)
            self._no_sync = no_sync() if callable(no_sync) else contextlib.nullcontext()
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        try:
            if exc_type is None:  # after an error the peers may not be here to average with
                self._average()
        finally:
            assert self._no_sync is not None
            self._no_sync.__exit__(exc_type, exc, traceback)
            self._no_sync = None

    def step(self) -> None:
        """Count one optimizer step; average the parameters on every ``local_sgd_steps``-th.

        Every process must call it the same number of times (averaging is collective).
        """
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        """Replace every parameter by its mean over the processes (in place)."""
        # An overlapped async save may still be copying the parameters: averaging them first
        # would fail that save (its copy would no longer match the checksum taken at save).
        fence = getattr(self.accelerator, "wait_for_snapshot", None)
        if callable(fence):
            fence()
        world = dist.get_world_size()
        with torch.no_grad():
            for param in self.model.parameters():
                dist.all_reduce(param.data, op=dist.ReduceOp.SUM)
                param.data.div_(world)
