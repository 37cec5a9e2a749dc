"""The training-loop part of the :class:`~accelkit.Accelerator`: ``prepare`` and the step.

What each prepared kind becomes is documented in :mod:`accelkit.training.loop`,
:mod:`accelkit.data.preparation` and :mod:`accelkit.training.optim`; this part holds the settings
``prepare`` needs and appends what it prepares to the
:class:`~accelkit._accelerator.prepared_objects.PreparedObjects` it was built with.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

import accelkit.data.preparation as _data
import accelkit.fsdp.runtime as _fsdp
import accelkit.training.dynamo as _dynamo
import accelkit.training.kwargs_handlers as _kwargs
import accelkit.training.loop as _training
import accelkit.training.optim as _optim
import accelkit.training.precision as _precision

if TYPE_CHECKING:
    from accelkit._accelerator.prepared_objects import PreparedObjects
    from accelkit._accelerator.processes import Processes
    from accelkit.data.preparation import DataLoaderConfiguration
    from accelkit.training.kwargs_handlers import KwargsHandler

__all__ = ["Training"]


class Training:
    """Prepares objects and runs the step: the implementation of the ``Accelerator`` methods of
    the same names (their documentation is this class's).

    Args:
        processes: this process and how processes are joined.
        prepared: where prepared objects are registered (its ``scaler`` scales fp16 losses).
        gradient_state: the accumulation state shared with optimizers and dataloaders.
        dataloader_config: how dataloaders are sharded.
        kwargs_handlers: the handlers given to the accelerator (``DistributedDataParallelKwargs``
            configure the DDP wrap).
        device_placement: move models and batches to the device unless told otherwise.
        step_scheduler_with_optimizer: step prepared schedulers with the optimizer.
        fsdp: the FSDP runtime when models are sharded, else None.
        dynamo_plugin: how prepared models are compiled.
        on_first_backward: called once, at the first ``backward()``: training starts there (the
            facade checks that a resumable project is resumed, before the first optimizer step).
        before_release: called by ``free_memory()`` first (waits for an overlapped save's
            background copy).
    """

    def __init__(
        self,
        processes: Processes,
        prepared: PreparedObjects,
        gradient_state: _optim.GradientState,
        dataloader_config: DataLoaderConfiguration,
        kwargs_handlers: list[KwargsHandler],
        *,
        device_placement: bool,
        step_scheduler_with_optimizer: bool,
        fsdp: _fsdp.FSDPRuntime | None,
        dynamo_plugin: _dynamo.TorchDynamoPlugin,
        on_first_backward: Callable[[], None] | None = None,
        before_release: Callable[[], None] | None = None,
    ) -> None:
        self.processes = processes
        self.prepared = prepared
        self.gradient_state = gradient_state
        self.dataloader_config = dataloader_config
        self.mixed_precision = processes.state.mixed_precision
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.fsdp = fsdp
        ddp = _kwargs.DistributedDataParallelKwargs
        self.ddp_kwargs = _kwargs.collect(kwargs_handlers, ddp)
        self.on_first_backward = on_first_backward
        self.before_release = before_release
        self._timed = False  # backward_seconds() was asked for: backward() is timed
        self._backward_seconds = 0.0
        self.ddp_handler: _kwargs.DistributedDataParallelKwargs | None = _kwargs.find(
            kwargs_handlers, ddp
        )
        self.dynamo_plugin = dynamo_plugin

    def _device(self, placement: bool | None) -> torch.device | None:
        place = self.device_placement if placement is None else placement
        return self.processes.state.device if place else None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and dataloaders; return them in the same order.

        Models go to :attr:`device` (wrapped in ``DistributedDataParallel`` on several processes,
        forward under autocast with mixed precision); optimizers and schedulers are wrapped to
        follow gradient accumulation and the fp16 scaler; dataloaders are sharded across
        processes. Other objects are returned unchanged, as in the reference, except objects that
        are almost surely a mistake (a ``Dataset``/``Sampler``, a class, a list holding models
        or optimizers), which raise ``TypeError`` naming their type and the fix.

        Args:
            *args: the objects.
            device_placement: one bool per object overriding ``Accelerator(device_placement=)``.

        Returns:
            The prepared object, or a tuple of them in the order given.
        """
        result = _training.prepare_all(args, device_placement, self._prepare_one)
        return result[0] if len(result) == 1 else result

    def _prepare_one(self, obj: Any, placement: bool | None) -> Any:
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, placement)
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, placement)
        if _training.is_scheduler(obj):
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Prepare one model (see :meth:`prepare`); ``evaluation_mode`` skips the DDP wrap."""
        if self.fsdp is not None:  # shard; re-point optimizers prepared before the model
            model = self.fsdp.prepare_model(model, self.prepared.optimizers)
            return _training.register(self.prepared.models, model)
        model = _training.prepare_model(
            model,
            device=self._device(device_placement),
            mixed_precision=self.mixed_precision,
            distributed=self.processes.state.use_distributed,
            evaluation_mode=evaluation_mode,
            ddp_kwargs=self.ddp_kwargs,
        )
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(model)
        model = _dynamo.compile_model(model, self.dynamo_plugin)
        return _training.register(self.prepared.models, model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> _optim.AcceleratedOptimizer:
        """Wrap one optimizer in an :class:`~accelkit.training.optim.AcceleratedOptimizer`."""
        if self.fsdp is not None:
            self.fsdp.prepare_optimizer(optimizer)
        if not isinstance(optimizer, _optim.AcceleratedOptimizer):
            optimizer = _optim.AcceleratedOptimizer(
                optimizer, self.gradient_state, self.prepared.scaler, self._device(device_placement)
            )
        return _training.register(self.prepared.optimizers, optimizer)

    def prepare_scheduler(self, scheduler: Any) -> _optim.AcceleratedScheduler:
        """Wrap one scheduler in an :class:`~accelkit.training.optim.AcceleratedScheduler`."""
        if not isinstance(scheduler, _optim.AcceleratedScheduler):
            scheduler = _optim.AcceleratedScheduler(
                scheduler,
                _training.optimizers_of(scheduler, self.prepared.optimizers),
                self.gradient_state,
                step_with_optimizer=self.step_scheduler_with_optimizer,
                split_batches=self.dataloader_config.split_batches,
                num_processes=self.processes.state.num_processes,
            )
        return _training.register(self.prepared.schedulers, scheduler)

    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader[Any],
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """Shard one dataloader for this process (see :mod:`accelkit.data.preparation`).

        ``slice_fn_for_dispatch`` takes a process's part of a dispatched batch
        (``dispatch_batches``; see :mod:`accelkit.data.dispatch`).
        """
        loader = _data.prepare_data_loader(
            data_loader,
            num_processes=self.processes.state.num_processes,
            process_index=self.processes.state.process_index,
            device=self._device(device_placement),
            config=self.dataloader_config,
            gradient_state=self.gradient_state,
            slice_fn=slice_fn_for_dispatch,
        )
        return _training.register(self.prepared.dataloaders, loader)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled in fp16."""
        if self.on_first_backward is not None:
            hook, self.on_first_backward = self.on_first_backward, None
            hook()
        steps = self.gradient_state.num_steps
        if steps > 1:
            loss = loss / steps
        if self.prepared.scaler is not None:
            loss = self.prepared.scaler.scale(loss)
        if self._timed:
            started = time.perf_counter()
            loss.backward(**kwargs)
            self._backward_seconds += time.perf_counter() - started
        else:
            loss.backward(**kwargs)

    def backward_seconds(self) -> Callable[[], float]:
        """Time :meth:`backward` from now on; returns the reader of its running total in
        seconds (the straggler report's: DDP's gradient all-reduce, where a fast rank waits for
        a slow one, runs inside ``backward``)."""
        self._timed = True
        return lambda: self._backward_seconds

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Run one micro-step: gradients sync only on every ``gradient_accumulation_steps``-th
        one and on the last batch of the dataloader (see :attr:`sync_gradients`)."""
        state = self.gradient_state
        if state.begin_micro_step() or state.plugin.sync_each_batch or not models:
            yield
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(_training.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip DDP's gradient all-reduce inside the block (a null context without DDP)."""
        return _training.no_sync(model)

    def trigger_sync_in_backward(
        self, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        """Make the next backward all-reduce although it runs after forwards under no_sync."""
        return _training.trigger_sync_in_backward(model)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        """Autocast the block to the mixed-precision dtype (a null context for ``"no"``).

        Args:
            autocast_handler: an object with ``to_kwargs()`` (or a dict) of ``torch.autocast``
                overrides, e.g. ``{"enabled": False}`` to return to fp32 inside the block.
        """
        kwargs = _training.handler_kwargs(autocast_handler)
        return _precision.autocast_context(
            self.mixed_precision, self.processes.state.device, **kwargs
        )

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather from all processes, dropping the samples padding added to the last batch."""
        return _training.gather_for_metrics(input_data, self.gradient_state, use_gather_object)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader leaving out the first ``num_batches`` batches (see
        :mod:`accelkit.data.preparation`)."""
        return _data.skip_first_batches(dataloader, num_batches)

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> torch.nn.Module:
        """The model without the DDP (and optionally autocast/compile) wrappers of prepare."""
        return _training.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's state dict (without the ``module.`` prefix of DDP when ``unwrap``)."""
        # A sharded (FSDP) model: a collective; full tensors on the main process, {} elsewhere.
        return _fsdp.get_state_dict(self.unwrap_model(model) if unwrap else model)

    def clear(self, *objects: Any) -> Any:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16 gradients by the loss scale (once per step; a no-op otherwise)."""
        optimizers = self.prepared.optimizers
        targets = optimizers if optimizer is None else _training.as_list(optimizer)
        _training.unscale_gradients(targets, optimizers, self.gradient_state)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """``torch.nn.utils.clip_grad_norm_`` after unscaling; returns the total norm.

        With fp16 on a micro-step that still accumulates, nothing is clipped and None is
        returned (see :func:`accelkit.training.loop.unscale_and_clip`).
        """
        return _training.unscale_and_clip(
            lambda: _fsdp.clip_grad_norm_(parameters, max_norm, norm_type=norm_type),
            self.prepared.optimizers,
            self.gradient_state,
            self.prepared.scaler,
        )

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` after unscaling."""
        _training.unscale_and_clip(
            lambda: torch.nn.utils.clip_grad_value_(parameters, clip_value),
            self.prepared.optimizers,
            self.gradient_state,
            self.prepared.scaler,
        )

    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Train on processes with different batch counts (``torch.distributed`` ``Join``)."""
        return _training.join_uneven_inputs(
            joinables, self.prepared.dataloaders, even_batches, self.processes.joined_by_ddp
        )

    def free_memory(self, *objects: Any) -> Any:
        """Forget every prepared object, reset :attr:`step`, and release cached memory.

        Returns:
            None for each object passed (assign them back to drop your references).
        """
        if self.before_release is not None:
            self.before_release()
        self.prepared.clear()
        self.gradient_state.reset()
        return _training.release_memory(len(objects))
