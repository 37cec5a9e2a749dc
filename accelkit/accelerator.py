"""The `Accelerator`: one object a training loop talks to.

This module is a facade. Each method is a few lines that hand the work to the module that owns
it: :mod:`accelkit.state` (who this process is), :mod:`accelkit.ops` (collectives),
:mod:`accelkit.data` and :mod:`accelkit.optim` (the training loop), :mod:`accelkit.trackers`
(experiment tracking) and :mod:`accelkit.checkpointing` (saving and loading).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from accelkit import ops
from accelkit.state import DistributedType, PartialState, PrecisionType, parse_mixed_precision

__all__ = ["Accelerator"]


class Accelerator:
    """Run the same training loop on 1 CPU, 1 GPU, N processes or N machines.

    Args:
        device_placement: move prepared models and batches to :attr:`device`.
        split_batches: split each batch across processes instead of giving each process its own
            batch (the total batch size then stays the one in the script).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; default from
            ``ACCELKIT_MIXED_PRECISION`` (set by ``accelkit launch --mixed_precision``).
        gradient_accumulation_steps: micro-steps per optimizer step (see :meth:`accumulate`).
        cpu: force the CPU even when CUDA is available.
        dataloader_config: a :class:`~accelkit.data.DataLoaderConfiguration`.
        fsdp_plugin: not supported yet; passing one raises.
        rng_types: accepted for compatibility; shuffling is synchronised through the sampler's
            generator.
        log_with: tracker name(s), :class:`~accelkit.trackers.GeneralTracker` instance(s), or
            ``"all"``.
        project_dir: root folder (or fsspec URL) for logs and checkpoints.
        project_config: a :class:`~accelkit.checkpointing.ProjectConfiguration`.
        step_scheduler_with_optimizer: step prepared schedulers together with the optimizer.
        tracker_errors: ``"warn"`` (default: a failing tracker is reported once and skipped) or
            ``"raise"``.

    Example:
        >>> accelerator = Accelerator()
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> for x, y in loader:
        ...     loss = loss_fn(model(x), y)
        ...     accelerator.backward(loss)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | PrecisionType | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        fsdp_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        logging_dir: str | None = None,
        tracker_errors: str = "warn",
        deepspeed_plugin: Any = None,
        megatron_lm_plugin: Any = None,
    ) -> None:
        for name, value in (
            ("deepspeed_plugin", deepspeed_plugin),
            ("megatron_lm_plugin", megatron_lm_plugin),
        ):
            if value is not None:
                raise ValueError(
                    f"accelkit does not support {name}; use fsdp_plugin for sharded training "
                    f"or remove {name}=... from Accelerator(...)."
                )
        self.state = PartialState(cpu=cpu)
        self.mixed_precision: str = parse_mixed_precision(mixed_precision).value
        self.device_placement = device_placement
        self.rng_types = rng_types
        self.kwargs_handlers = list(kwargs_handlers or [])
        self._trigger = torch.tensor(0, device=self.state.device)
        # ===== training: init =====
        # ===== end training: init =====
        # ===== checkpointing: init =====
        # ===== end checkpointing: init =====
        # ===== tracking: init =====
        # ===== end tracking: init =====

    # ================================================================= process state

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        """How processes are connected (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``)."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        """Total number of processes in the run."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """Global index of this process."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """Index of this process on its machine."""
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        """True once across all machines."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True once per machine."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """True on the process of the highest index."""
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.state.use_distributed

    # ============================================================== process control

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

    def set_trigger(self) -> None:
        """Raise a flag on this process; :meth:`check_trigger` sees it on every process."""
        self._trigger.fill_(1)

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger`; then resets it."""
        if ops.reduce(self._trigger, reduction="sum").item() > 0:
            self._trigger.fill_(0)
            return True
        return False

    # ================================================================== collectives

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

    # ===== training: methods =====
    # ===== end training: methods =====

    # ===== checkpointing: methods =====
    # ===== end checkpointing: methods =====

    # ===== tracking: methods =====
    # ===== end tracking: methods =====

    def end_training(self) -> None:
        """Finish every tracker and wait for pending saves; call once at the end of the script."""
        # ===== end_training hooks =====
        # ===== end end_training hooks =====
