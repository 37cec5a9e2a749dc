"""The `Accelerator`: one object a training loop talks to.

This module is a facade. Each method is a few lines that hand the work to the module that owns
it: :mod:`accelkit.state` (who this process is), :mod:`accelkit.ops` (collectives),
:mod:`accelkit.data` and :mod:`accelkit.optim` (the training loop), :mod:`accelkit.trackers`
(experiment tracking) and :mod:`accelkit.checkpointing` (saving and loading).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from accelkit import data as _data
from accelkit import dynamo as _dynamo
from accelkit import fsdp as _fsdp
from accelkit import kwargs_handlers as _kwargs
from accelkit import optim as _optim
from accelkit import precision as _precision
from accelkit import preflight as _preflight
from accelkit import training as _training
from accelkit._checkpointing_api import CheckpointingAPI
from accelkit._compat_api import CompatAPI
from accelkit._process_api import ProcessAPI
from accelkit.checkpointing import async_save as _ckpt_async
from accelkit.checkpointing import config as _ckpt_config
from accelkit.checkpointing import manager as _ckpt_manager
from accelkit.data import DataLoaderConfiguration
from accelkit.optim import GradientAccumulationPlugin
from accelkit.state import AcceleratorState, PrecisionType, refuse_out_of_scope_plugins
from accelkit.trackers import GeneralTracker, TrackerHub

# DataLoaderConfiguration and GradientAccumulationPlugin are importable from here, as in the
# reference (``from accelerate.accelerator import Accelerator, DataLoaderConfiguration``).
__all__ = ["Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin"]


class Accelerator(ProcessAPI, CompatAPI, CheckpointingAPI):
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
        fsdp_plugin: a :class:`~accelkit.fsdp.FullyShardedDataParallelPlugin`: ``prepare``
            shards models with FSDP2 (default: the launcher's ``--use_fsdp`` settings).
        rng_types: accepted for compatibility; shuffling is synchronised through the sampler's
            generator.
        log_with: tracker name(s), :class:`~accelkit.trackers.GeneralTracker` instance(s), or
            ``"all"``.
        project_dir: root folder (or fsspec URL) for logs and checkpoints.
        project_config: a :class:`~accelkit.checkpointing.ProjectConfiguration`.
        step_scheduler_with_optimizer: step prepared schedulers together with the optimizer.
        tracker_errors: ``"warn"`` (default: a failing tracker is reported once and skipped) or
            ``"raise"``.
        dynamo_backend: compile prepared models with ``torch.compile`` and this backend (see
            :mod:`accelkit.dynamo`); or ``dynamo_plugin``, a ``TorchDynamoPlugin``.
        deepspeed_plugin, deepspeed_plugins, megatron_lm_plugin, torch_tp_plugin,
            parallelism_config: accepted by name for compatibility and refused with
            ``ValueError`` unless None (out of accelkit's scope).

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
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: _optim.GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: _dynamo.TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        logging_dir: str | None = None,
        tracker_errors: str = "warn",
    ) -> None:
        refuse_out_of_scope_plugins(deepspeed_plugin=deepspeed_plugins)
        self.kwargs_handlers = list(kwargs_handlers or [])
        self.dynamo_plugin = _dynamo.resolve_dynamo_plugin(dynamo_plugin, dynamo_backend)
        fsdp_plugin = _fsdp.plugin_from_env_or(fsdp_plugin)  # the launcher's --use_fsdp too
        self.state = AcceleratorState(
            mixed_precision,
            cpu,
            self.dynamo_plugin,
            deepspeed_plugin,
            fsdp_plugin,
            torch_tp_plugin,
            megatron_lm_plugin,
            parallelism_config,
            _from_accelerator=True,
            **_kwargs.collect(self.kwargs_handlers, _kwargs.InitProcessGroupKwargs),
        )
        self.mixed_precision: str = self.state.mixed_precision
        self._log_with = log_with
        self.device_placement = device_placement
        self.rng_types = rng_types
        self._trigger = torch.tensor(0, device=self.state.device)
        # ===== training: init =====
        self.dataloader_config = _data.resolve_config(dataloader_config, split_batches)
        self.gradient_state = _optim.GradientState(
            _optim.resolve_plugin(gradient_accumulation_plugin, gradient_accumulation_steps)
        )
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scaler = _precision.make_grad_scaler(
            self.mixed_precision,
            self.device,
            **_kwargs.collect(self.kwargs_handlers, _kwargs.GradScalerKwargs),
        )
        self._ddp_kwargs = _kwargs.collect(
            self.kwargs_handlers, _kwargs.DistributedDataParallelKwargs
        )
        self._ddp_handler = _kwargs.find(
            self.kwargs_handlers, _kwargs.DistributedDataParallelKwargs
        )
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[_optim.AcceleratedOptimizer] = []
        self._schedulers: list[_optim.AcceleratedScheduler] = []
        self._dataloaders: list[Any] = []
        self._fsdp = _fsdp.FSDPRuntime.create(fsdp_plugin, self.device, self.mixed_precision)
        # ===== end training: init =====
        # ===== checkpointing: init =====
        self.project_configuration = _ckpt_config.resolve_project_configuration(
            project_config, project_dir, logging_dir
        )
        self._checkpoints = _ckpt_manager.CheckpointManager(self.project_configuration, self.state)
        self._async_saves = _ckpt_async.AsyncSaver(self._checkpoints)
        # ===== end checkpointing: init =====
        # ===== tracking: init =====
        self._trackers = TrackerHub.create(
            log_with,
            logging_dir=self.project_configuration.logging_dir,
            is_main_process=self.state.is_main_process,
            on_error=tracker_errors,
        )
        # Unusable folders or storage fail here, not at the first log or save an epoch later.
        _preflight.check_run(
            self.project_configuration, bool(self._trackers.requested_names), self.state
        )
        # ===== end tracking: init =====

    # Process state, process control, collectives: see accelkit/_process_api.py (ProcessAPI).

    # ===== training: methods =====
    # Preparing objects. What each kind becomes is documented in accelkit.training/data/optim.

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
            return self.prepare_data_loader(obj, device_placement=placement)
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
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
        if self._fsdp is not None:  # shard; re-point optimizers prepared before the model
            model = self._fsdp.prepare_model(model, self._optimizers)
            return _training.register(self._models, model)
        place = self.device_placement if device_placement is None else device_placement
        model = _training.prepare_model(
            model,
            device=self.device if place else None,
            mixed_precision=self.mixed_precision,
            distributed=self.use_distributed,
            evaluation_mode=evaluation_mode,
            ddp_kwargs=self._ddp_kwargs,
        )
        if self._ddp_handler is not None:
            self._ddp_handler.register_comm_hook(model)
        model = _dynamo.compile_model(model, self.dynamo_plugin)
        return _training.register(self._models, model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> _optim.AcceleratedOptimizer:
        """Wrap one optimizer in an :class:`~accelkit.optim.AcceleratedOptimizer`."""
        if self._fsdp is not None:
            self._fsdp.prepare_optimizer(optimizer)
        if not isinstance(optimizer, _optim.AcceleratedOptimizer):
            place = self.device_placement if device_placement is None else device_placement
            optimizer = _optim.AcceleratedOptimizer(
                optimizer, self.gradient_state, self.scaler, self.device if place else None
            )
        return _training.register(self._optimizers, optimizer)

    def prepare_scheduler(self, scheduler: Any) -> _optim.AcceleratedScheduler:
        """Wrap one scheduler in an :class:`~accelkit.optim.AcceleratedScheduler`."""
        if not isinstance(scheduler, _optim.AcceleratedScheduler):
            scheduler = _optim.AcceleratedScheduler(
                scheduler,
                _training.optimizers_of(scheduler, self._optimizers),
                self.gradient_state,
                step_with_optimizer=self.step_scheduler_with_optimizer,
                split_batches=self.dataloader_config.split_batches,
                num_processes=self.num_processes,
            )
        return _training.register(self._schedulers, scheduler)

    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader[Any],
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """Shard one dataloader for this process (see :mod:`accelkit.data`).

        ``slice_fn_for_dispatch`` takes a process's part of a dispatched batch
        (``dispatch_batches``; see :mod:`accelkit.dispatch`).
        """
        place = self.device_placement if device_placement is None else device_placement
        loader = _data.prepare_data_loader(
            data_loader,
            num_processes=self.num_processes,
            process_index=self.process_index,
            device=self.device if place else None,
            config=self.dataloader_config,
            gradient_state=self.gradient_state,
            slice_fn=slice_fn_for_dispatch,
        )
        return _training.register(self._dataloaders, loader)

    # The step: backward, accumulation, mixed precision.

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled in fp16."""
        steps = self.gradient_state.num_steps
        if steps > 1:
            loss = loss / steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = _optim.GradientAccumulationPlugin(num_steps=value).num_steps

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step whose gradients are final (the optimizer really steps)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def step(self) -> int:
        """Micro-steps counted by :meth:`accumulate` (the reference's ``step``; checkpointed)."""
        return self.gradient_state.micro_step

    @step.setter
    def step(self, value: int) -> None:
        self.gradient_state.micro_step = int(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for inf/NaN fp16 gradients."""
        return any(opt.step_was_skipped for opt in self._optimizers)

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
        return _precision.autocast_context(self.mixed_precision, self.device, **kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16 gradients by the loss scale (once per step; a no-op otherwise)."""
        targets = self._optimizers if optimizer is None else _training.as_list(optimizer)
        _training.unscale_gradients(targets, self._optimizers, self.gradient_state)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """``torch.nn.utils.clip_grad_norm_`` after unscaling; returns the total norm.

        With fp16 on a micro-step that still accumulates, nothing is clipped and None is
        returned (see :func:`accelkit.training.unscale_and_clip`).
        """
        return _training.unscale_and_clip(
            lambda: _fsdp.clip_grad_norm_(parameters, max_norm, norm_type=norm_type),
            self._optimizers,
            self.gradient_state,
            self.scaler,
        )

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` after unscaling."""
        _training.unscale_and_clip(
            lambda: torch.nn.utils.clip_grad_value_(parameters, clip_value),
            self._optimizers,
            self.gradient_state,
            self.scaler,
        )

    # Evaluation, resuming, cleanup.

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather from all processes, dropping the samples padding added to the last batch."""
        return _training.gather_for_metrics(input_data, self.gradient_state, use_gather_object)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader leaving out the first ``num_batches`` batches (see :mod:`accelkit.data`)."""
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

    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Train on processes with different batch counts (``torch.distributed`` ``Join``)."""
        return _training.join_uneven_inputs(
            joinables, self._dataloaders, even_batches, self._joined_by_ddp
        )

    def free_memory(self, *objects: Any) -> Any:
        """Forget every prepared object, reset :attr:`step`, and release cached memory.

        Returns:
            None for each object passed (assign them back to drop your references).
        """
        for registry in (self._models, self._optimizers, self._schedulers, self._dataloaders):
            registry.clear()
        self.gradient_state.reset()
        return _training.release_memory(len(objects))

    def clear(self, *objects: Any) -> Any:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    # ===== end training: methods =====

    # Saving and loading: see accelkit/_checkpointing_api.py (CheckpointingAPI).

    # ===== tracking: methods =====
    @property
    def trackers(self) -> list[GeneralTracker]:
        """The started trackers of this process (none on other processes than the main one)."""
        return self._trackers.trackers

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start every tracker of ``log_with`` and store ``config`` (call on every process).

        Args:
            project_name: the project / run name each tracker receives.
            config: hyperparameters; nested dicts, lists, tensors, paths and ``None`` are
                converted as each backend needs.
            init_kwargs: tracker name -> keyword arguments, e.g.
                ``{"wandb": {"tags": ["baseline"]}}``.
        """
        self._trackers.init(project_name, config, init_kwargs)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Log ``values`` at ``step`` to every tracker, without waiting for the backends.

        Values are copied before this returns (a CUDA tensor is copied on its stream, never
        synchronised); a background worker per tracker writes them in order. On processes
        other than the main one this returns at once.

        Args:
            values: metric name -> value (numbers, tensors, strings, backend objects).
            step: the training step.
            log_kwargs: tracker name -> keyword arguments for that tracker's ``log``.
        """
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its backend object with ``unwrap=True``).

        On processes other than the main one, returns a stand-in whose methods do nothing.
        """
        return self._trackers.get(name, unwrap=unwrap)

    # ===== end tracking: methods =====

    def end_training(self) -> None:
        """Finish every tracker and wait for pending saves; call once at the end of the script."""
        # ===== end_training hooks =====
        self._trackers.finish()
        self._async_saves.wait()
        # ===== end end_training hooks =====
