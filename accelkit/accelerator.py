"""The `Accelerator`: one object a training loop talks to.

This module is a facade. Each member is a short delegation to the part that owns the work,
built in ``__init__`` with its dependencies passed explicitly:
:class:`~accelkit._accelerator.processes.Processes` (who this process is, the trigger flag),
:class:`~accelkit._accelerator.training.Training` (``prepare`` and the step),
:class:`~accelkit._accelerator.checkpointing.Checkpointing` (saving and loading),
:class:`~accelkit._accelerator.settings.Settings` (the reference's settings views) and
:class:`~accelkit.trackers.TrackerHub` (experiment tracking). The objects ``prepare`` returns
are registered in one :class:`~accelkit._accelerator.prepared_objects.PreparedObjects` the parts
share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import torch

import accelkit._accelerator.preflight as _preflight
import accelkit.checkpointing.config as _ckpt_config
import accelkit.checkpointing.tiered as _ckpt_tiered
import accelkit.fsdp.runtime as _fsdp
import accelkit.training.dynamo as _dynamo
import accelkit.training.kwargs_handlers as _kwargs
import accelkit.training.loop as _training
import accelkit.training.optim as _optim
import accelkit.training.precision as _precision
import accelkit.training.profiling as _profiling
from accelkit._accelerator.checkpointing import Checkpointing
from accelkit._accelerator.delegation import documented_by, forward
from accelkit._accelerator.experiment import ExperimentLink
from accelkit._accelerator.memory import MemorySnapshots
from accelkit._accelerator.preemption import Preemption
from accelkit._accelerator.prepared_objects import PreparedObjects
from accelkit._accelerator.processes import Processes
from accelkit._accelerator.resume import ResumeCheck
from accelkit._accelerator.settings import Settings
from accelkit._accelerator.training import Training
from accelkit._accelerator.watchdog import HangWatch, StragglerWatch
from accelkit.data.preparation import DataLoaderConfiguration, resolve_config
from accelkit.runtime.state import AcceleratorState, DistributedType, refuse_out_of_scope_plugins
from accelkit.trackers import GeneralTracker, TrackerHub, TrackerOptions
from accelkit.training.optim import GradientAccumulationPlugin

if TYPE_CHECKING:
    import os

    from accelkit.checkpointing.commit.async_save import AsyncCheckpoint
    from accelkit.checkpointing.config import ProjectConfiguration
    from accelkit.fsdp.plugin import FullyShardedDataParallelPlugin
    from accelkit.runtime.saving import SavePolicy
    from accelkit.runtime.state import PrecisionType
    from accelkit.trackers import LoggerType
    from accelkit.training.dynamo import DynamoBackend, TorchDynamoPlugin
    from accelkit.training.kwargs_handlers import KwargsHandler

    _Tracker = str | LoggerType | GeneralTracker

# DataLoaderConfiguration and GradientAccumulationPlugin are importable from here, as in the
# reference (``from accelerate.accelerator import Accelerator, DataLoaderConfiguration``).
__all__ = ["Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin"]


def _processes_part(accelerator: Accelerator) -> Processes:
    return accelerator._processes


def _training_part(accelerator: Accelerator) -> Training:
    return accelerator._training


def _checkpointing_part(accelerator: Accelerator) -> Checkpointing:
    return accelerator._checkpointing


def _settings_part(accelerator: Accelerator) -> Settings:
    return accelerator._settings


def _preemption_part(accelerator: Accelerator) -> Preemption:
    return accelerator._preemption


def _watchdog_part(accelerator: Accelerator) -> HangWatch:
    return accelerator._watchdog


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
        dataloader_config: a :class:`~accelkit.data.preparation.DataLoaderConfiguration`.
        fsdp_plugin: a :class:`~accelkit.fsdp.runtime.FullyShardedDataParallelPlugin`: ``prepare``
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
        save_policy: when :meth:`should_save` answers True: a
            :class:`~accelkit.runtime.saving.SavePolicy` (``EveryNSteps``, ``EverySeconds``,
            ``AnyOf``, or the user's own), instead of ``ProjectConfiguration``'s
            ``save_every_steps``/``save_every_seconds``. An accelkit extension (Accelerate's
            scripts decide in their own loop).
        tracker_options: the trackers' waits, retries and journal
            (:class:`~accelkit.trackers.TrackerOptions`; fields left ``None`` take their
            environment variable (``docs/reference/environment.md``), else the default). An
            accelkit extension.
        strict_resume: at the first step after :meth:`load_state`, raise
            :class:`~accelkit.checkpointing.errors.ResumeMismatchError` (on every process)
            instead of warning when the run would not consume what the saved run's next step
            would have: another data order, batch size, sampler, random stream or world size
            (each checkpoint records a fingerprint of them; see
            :mod:`accelkit._accelerator.resume`). An accelkit extension.
        hang_timeout_seconds: seconds a process may go without a step boundary before it
            counts as hung: every process then writes its Python stacks, the trackers get a
            ``watchdog/hang`` event and the job exits with ``preemption_exit_code`` (75); see
            :meth:`not_a_hang` and ``docs/guides/watchdog.md``. ``None`` (default): no
            watchdog. An accelkit extension.
        straggler_fraction: report a rank (once, a warning and a ``straggler/*`` tracker event
            naming it and its host) whose step, outside ``backward()``, stays this fraction
            slower than the other ranks' median (0.2: 20%) over ``straggler_steps`` optimizer
            steps; the times ride on the save decisions' per-step agreement. ``None``
            (default): no report. An accelkit extension.
        straggler_steps: see ``straggler_fraction``.
        dynamo_backend: compile prepared models with ``torch.compile`` and this backend (see
            :mod:`accelkit.training.dynamo`); or ``dynamo_plugin``, a ``TorchDynamoPlugin``.
        deepspeed_plugin: accepted by name for compatibility and refused with ``ValueError``
            unless None (out of accelkit's scope), as are ``deepspeed_plugins``,
            ``megatron_lm_plugin``, ``torch_tp_plugin`` and ``parallelism_config``.

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
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: object = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        torch_tp_plugin: object = None,
        megatron_lm_plugin: object = None,
        rng_types: list[str] | None = None,
        log_with: _Tracker | list[_Tracker] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: object = None,
        parallelism_config: object = None,
        logging_dir: str | os.PathLike[str] | None = None,
        tracker_errors: str = "warn",
        save_policy: SavePolicy | None = None,
        tracker_options: TrackerOptions | None = None,
        strict_resume: bool = False,
        hang_timeout_seconds: float | None = None,
        straggler_fraction: float | None = None,
        straggler_steps: int = 50,
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
        self.rng_types = rng_types
        self.dataloader_config = resolve_config(dataloader_config, split_batches)
        self.gradient_state = _optim.GradientState(
            _optim.resolve_plugin(gradient_accumulation_plugin, gradient_accumulation_steps)
        )
        scaler_kwargs = _kwargs.collect(self.kwargs_handlers, _kwargs.GradScalerKwargs)
        scaler = _precision.make_grad_scaler(
            self.mixed_precision, self.state.device, **scaler_kwargs
        )
        self._prepared = PreparedObjects(scaler)
        # The reference's registry lists, under the reference's names (the same list objects).
        self._models = self._prepared.models
        self._optimizers = self._prepared.optimizers
        self._schedulers = self._prepared.schedulers
        self._dataloaders = self._prepared.dataloaders
        fsdp = _fsdp.FSDPRuntime.create(fsdp_plugin, self.state.device, self.mixed_precision)
        self._processes = Processes(self.state, sharded=fsdp is not None)
        self._settings = Settings(
            self.state, self.dataloader_config, self.kwargs_handlers, log_with
        )
        self.project_configuration = _ckpt_config.resolve_project_configuration(
            project_config, project_dir, logging_dir
        )
        self._checkpoints = _ckpt_tiered.TieredCheckpointManager(
            self.project_configuration, self.state
        )
        self._checkpointing = Checkpointing(
            self._checkpoints,
            self._prepared,
            self.gradient_state,
            self.project_configuration,
            _training.unwrap_model,
            ResumeCheck(self.state, self.gradient_state, self._prepared, strict=strict_resume),
        )
        self._training = Training(
            self._processes,
            self._prepared,
            self.gradient_state,
            self.dataloader_config,
            self.kwargs_handlers,
            device_placement=device_placement,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            fsdp=fsdp,
            dynamo_plugin=self.dynamo_plugin,
            # Checkpoints of an earlier run that training would collide with: warned about at
            # the first backward() (or save_state()) unless load_state() ran first.
            on_first_backward=self._checkpointing.before_training,
            # free_memory() must not drop tensors an overlapped save is still copying.
            before_release=self._checkpointing.wait_for_snapshot,
        )
        self._ddp_kwargs = self._training.ddp_kwargs
        self._trackers = TrackerHub.create(
            log_with,
            logging_dir=self.project_configuration.logging_dir,
            is_main_process=self.state.is_main_process,
            on_error=tracker_errors,
            defer_start=self.project_configuration.continue_tracker_runs,
            options=tracker_options,
        )
        self._experiment = ExperimentLink(
            self._trackers,
            continue_runs=self.project_configuration.continue_tracker_runs,
            checkpoint_events=self.project_configuration.checkpoint_events,
            gradient_state=self.gradient_state,
        )
        self._checkpoints.listener = self._experiment
        # Stragglers: their step times ride on the preemption part's agreement.
        self._stragglers = StragglerWatch(
            straggler_fraction,
            straggler_steps,
            self.state,
            self._training.backward_seconds,
            self.log,
        )
        # Save decisions and preemption signals (ProjectConfiguration.save_every_*,
        # preemption_signals): last, once everything a preemption exit cleans up exists.
        self._preemption = Preemption(
            self.project_configuration,
            self.state,
            self.gradient_state,
            self._checkpointing,
            self.end_training,
            save_policy,
            self._stragglers.rider,
        )
        # The memory tier's snapshots (ProjectConfiguration.memory): after the preemption
        # part, whose save at the same boundary comes first.
        self._memory = MemorySnapshots(
            self.project_configuration,
            self.state,
            self.gradient_state,
            self._checkpointing,
            self._checkpoints.memory,
        )
        # The hang watchdog (hang_timeout_seconds): a thread counting step boundaries.
        self._watchdog = HangWatch(
            hang_timeout_seconds,
            self.project_configuration,
            self.state,
            self.gradient_state,
            self.log,
            self._trackers.finish,
            self._checkpointing.run_inside,
        )
        # Unusable folders or storage fail here, not at the first log or save an epoch later.
        _preflight.check_run(
            self.project_configuration, bool(self._trackers.requested_names), self.state
        )
        self._checkpointing.look_for_earlier_checkpoints()

    # Who this process is (AcceleratorState), process control, collectives (accelkit.runtime.ops).

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        """How processes are connected (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``)."""
        return self._processes.distributed_type

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

    print = forward(Processes.print, _processes_part)
    wait_for_everyone = forward(Processes.wait_for_everyone, _processes_part)
    main_process_first = forward(Processes.main_process_first, _processes_part)
    local_main_process_first = forward(Processes.local_main_process_first, _processes_part)
    on_main_process = forward(Processes.on_main_process, _processes_part)
    on_local_main_process = forward(Processes.on_local_main_process, _processes_part)
    on_last_process = forward(Processes.on_last_process, _processes_part)
    on_process = forward(Processes.on_process, _processes_part)
    on_local_process = forward(Processes.on_local_process, _processes_part)
    split_between_processes = forward(Processes.split_between_processes, _processes_part)
    set_trigger = forward(Processes.set_trigger, _processes_part)
    check_trigger = forward(Processes.check_trigger, _processes_part)
    gather = forward(Processes.gather, _processes_part)
    reduce = forward(Processes.reduce, _processes_part)
    pad_across_processes = forward(Processes.pad_across_processes, _processes_part)

    # Preparing objects and the step (Training). What each kind becomes is documented in
    # accelkit.training.loop/data/optim.

    prepare = forward(Training.prepare, _training_part)
    prepare_model = forward(Training.prepare_model, _training_part)
    prepare_optimizer = forward(Training.prepare_optimizer, _training_part)
    prepare_scheduler = forward(Training.prepare_scheduler, _training_part)
    prepare_data_loader = forward(Training.prepare_data_loader, _training_part)
    backward = forward(Training.backward, _training_part)

    @property
    def device_placement(self) -> bool:
        """Whether ``prepare`` moves models and batches to :attr:`device` by default."""
        return self._training.device_placement

    @device_placement.setter
    def device_placement(self, value: bool) -> None:
        self._training.device_placement = value

    @property
    def step_scheduler_with_optimizer(self) -> bool:
        """Whether schedulers prepared from now on step together with the optimizer."""
        return self._training.step_scheduler_with_optimizer

    @step_scheduler_with_optimizer.setter
    def step_scheduler_with_optimizer(self, value: bool) -> None:
        self._training.step_scheduler_with_optimizer = value

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler (None otherwise); saved and restored with the checkpoint."""
        return self._prepared.scaler

    @scaler.setter
    def scaler(self, value: torch.amp.GradScaler | None) -> None:
        self._prepared.scaler = value

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
        return any(opt.step_was_skipped for opt in self._prepared.optimizers)

    accumulate = forward(Training.accumulate, _training_part)
    no_sync = forward(Training.no_sync, _training_part)
    trigger_sync_in_backward = forward(Training.trigger_sync_in_backward, _training_part)
    autocast = forward(Training.autocast, _training_part)
    unscale_gradients = forward(Training.unscale_gradients, _training_part)
    clip_grad_norm_ = forward(Training.clip_grad_norm_, _training_part)
    clip_grad_value_ = forward(Training.clip_grad_value_, _training_part)

    # Evaluation, resuming, cleanup.

    gather_for_metrics = forward(Training.gather_for_metrics, _training_part)
    skip_first_batches = forward(Training.skip_first_batches, _training_part)
    unwrap_model = forward(Training.unwrap_model, _training_part)
    get_state_dict = forward(Training.get_state_dict, _training_part)
    join_uneven_inputs = forward(Training.join_uneven_inputs, _training_part)
    free_memory = forward(Training.free_memory, _training_part)
    clear = forward(Training.clear, _training_part)

    # Saving and loading (Checkpointing).

    @property
    def project_dir(self) -> str | None:
        """Root folder (or fsspec URL) for logs and checkpoints."""
        return self._checkpointing.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Folder for trackers' logs."""
        return self._checkpointing.logging_dir

    @property
    def save_iteration(self) -> int:
        """Number of the next automatically named checkpoint."""
        return self._checkpointing.save_iteration

    @overload
    def save_state(
        self,
        output_dir: str | None = ...,
        safe_serialization: bool = ...,
        *,
        async_save: Literal[True],
        **kwargs: Any,
    ) -> AsyncCheckpoint: ...

    @overload
    def save_state(
        self,
        output_dir: str | None = ...,
        safe_serialization: bool = ...,
        *,
        async_save: Literal[False],
        **kwargs: Any,
    ) -> str: ...

    @overload
    def save_state(
        self,
        output_dir: str | None = ...,
        safe_serialization: bool = ...,
        *,
        async_save: None = ...,
        **kwargs: Any,
    ) -> Any: ...

    @documented_by(Checkpointing.save_state)
    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        return self._checkpointing.save_state(
            output_dir, safe_serialization, async_save=async_save, **kwargs
        )

    wait_for_checkpoints = forward(Checkpointing.wait_for_checkpoints, _checkpointing_part)
    wait_for_snapshot = forward(Checkpointing.wait_for_snapshot, _checkpointing_part)
    should_save = forward(Preemption.should_save, _preemption_part)
    not_a_hang = forward(HangWatch.not_a_hang, _watchdog_part)

    @property
    def preemption_requested(self) -> bool:
        """True on every process, from the same step boundary on, once any process received one
        of ``ProjectConfiguration.preemption_signals``; reading it marks the script as saving by
        itself (see :meth:`should_save` and ``docs/guides/preemption.md``)."""
        return self._preemption.preemption_requested

    load_state = forward(Checkpointing.load_state, _checkpointing_part)
    register_for_checkpointing = forward(
        Checkpointing.register_for_checkpointing, _checkpointing_part
    )
    register_save_state_pre_hook = forward(
        Checkpointing.register_save_state_pre_hook, _checkpointing_part
    )
    register_load_state_pre_hook = forward(
        Checkpointing.register_load_state_pre_hook, _checkpointing_part
    )
    save = forward(Checkpointing.save, _checkpointing_part)
    save_model = forward(Checkpointing.save_model, _checkpointing_part)

    # Experiment tracking (TrackerHub).

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
            step: the training step. Without one, the step is a counter kept by accelkit: 0 at
                the run's first ``log()``, then one more per call; a call with a ``step`` sets
                it, so the next call without one logs at ``step + 1``. Every tracker gets the
                same step (Accelerate leaves it to each backend: TensorBoard and MLflow then
                put every point at step 0).
            log_kwargs: tracker name -> keyword arguments for that tracker's ``log``.
        """
        self._experiment.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its backend object with ``unwrap=True``).

        On processes other than the main one, returns a stand-in whose methods do nothing.
        """
        return self._trackers.get(name, unwrap=unwrap)

    def end_training(self) -> None:
        """Wait for pending saves, drain the replication queue (up to
        ``ProjectConfiguration.replicate_deadline_seconds``, naming what is left behind), then
        finish every tracker and the preemption handling; call once at the end of the script."""
        self._watchdog.close()  # waiting for saves and trackers makes no step progress
        self._memory.close()
        try:
            self._checkpointing.wait_for_checkpoints()
        finally:
            try:
                self._checkpoints.close_replication()
            finally:
                try:
                    self._trackers.finish()
                finally:
                    self._preemption.close()

    # The reference's settings views (Settings); constants for what accelkit leaves out.

    @property
    def split_batches(self) -> bool:
        """Whether each batch is split across processes (``DataLoaderConfiguration``)."""
        return self._settings.split_batches

    @property
    def even_batches(self) -> bool:
        """Whether every process gets the same number of batches."""
        return self._settings.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._settings.even_batches = value

    @property
    def dispatch_batches(self) -> bool | None:
        """Whether the main process reads and dispatches batches (always off in accelkit)."""
        return self._settings.dispatch_batches

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared dataloaders are torchdata ``StatefulDataLoader`` s."""
        return self._settings.use_stateful_dataloader

    @property
    def use_seedable_sampler(self) -> bool:
        """The ``DataLoaderConfiguration.use_seedable_sampler`` setting."""
        return self._settings.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """Whether batches are copied to the device asynchronously."""
        return self._settings.non_blocking

    @property
    def log_with(self) -> list[Any]:
        """The trackers asked for in ``Accelerator(log_with=...)``, as a list."""
        return self._settings.log_with

    @property
    def native_amp(self) -> bool:
        """Whether ``torch.autocast`` mixed precision is on."""
        return self._settings.native_amp

    @property
    def use_fp16(self) -> bool:
        """Whether ``mixed_precision`` is ``"fp16"``."""
        return self._settings.use_fp16

    @property
    def is_fsdp2(self) -> bool:
        """True when models are sharded with FSDP (always FSDP2 in accelkit)."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def multi_device(self) -> bool:
        """Whether several GPUs take part (``MULTI_GPU``)."""
        return self._settings.multi_device

    profile = forward(Settings.profile, _settings_part)

    @property
    def deepspeed_plugin(self) -> None:
        """Always None: DeepSpeed is out of accelkit's scope."""
        return None

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

    @property
    def ddp_handler(self) -> _kwargs.DistributedDataParallelKwargs | None:
        """The ``DistributedDataParallelKwargs`` given in ``kwargs_handlers`` (or None)."""
        return self._settings.ddp_handler

    @property
    def scaler_handler(self) -> _kwargs.GradScalerKwargs | None:
        """The ``GradScalerKwargs`` given in ``kwargs_handlers`` (or None)."""
        return self._settings.scaler_handler

    @property
    def init_handler(self) -> _kwargs.InitProcessGroupKwargs | None:
        """The ``InitProcessGroupKwargs`` given in ``kwargs_handlers`` (or None)."""
        return self._settings.init_handler

    @property
    def autocast_handler(self) -> _kwargs.AutocastKwargs | None:
        """The ``AutocastKwargs`` given in ``kwargs_handlers`` (or None)."""
        return self._settings.autocast_handler

    @property
    def profile_handler(self) -> _profiling.ProfileKwargs | None:
        """The ``ProfileKwargs`` given in ``kwargs_handlers`` (or None)."""
        return self._settings.profile_handler

    @property
    def fp8_recipe_handler(self) -> None:
        """Always None: FP8 training is out of accelkit's scope (its recipe handlers are
        refused by name); Accelerate's scripts read it (``if ... is not None``)."""
        return None

    @property
    def te_recipe_handler(self) -> None:
        """Always None (FP8 through Transformer Engine is out of scope)."""
        return None

    @property
    def ao_recipe_handler(self) -> None:
        """Always None (FP8 through torchao is out of scope)."""
        return None

    @property
    def msamp_recipe_handler(self) -> None:
        """Always None (FP8 through MS-AMP is out of scope)."""
        return None

    @property
    def has_fp8_handler(self) -> bool:
        """Always False: FP8 training is out of accelkit's scope."""
        return False

    @property
    def fp8_enabled(self) -> bool:
        """Always False: ``mixed_precision="fp8"`` is refused by name."""
        return False

    @property
    def delayed_fp8_autocast(self) -> bool:
        """Always False: FP8 training is out of accelkit's scope."""
        return False

    @property
    def has_lomo_optimizer(self) -> bool:
        """Always False: LOMO optimizers (``fused_backward``) are not supported."""
        return False
