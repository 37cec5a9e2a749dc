"""The saving and loading part of the :class:`~accelkit.Accelerator`.

Split from ``accelerator.py`` along the seam between running a training loop and persisting it:
each method hands the work to :mod:`accelkit.checkpointing` (the commit protocol, the layout,
storage) and reads only the objects ``prepare`` registered in the
:class:`~accelkit._accelerator.prepared_objects.PreparedObjects` it was built with.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

import accelkit.checkpointing.formats.model_io as _ckpt_model_io
import accelkit.checkpointing.manager as _ckpt_manager
import accelkit.checkpointing.tiered as _ckpt_tiered
import accelkit.fsdp.runtime as _fsdp
from accelkit.checkpointing.catalog.listing import loadable_automatic
from accelkit.checkpointing.commit.async_save import AsyncCheckpoint
from accelkit.checkpointing.errors import UnresumedProjectWarning
from accelkit.checkpointing.formats.layout import checkpoint_name
from accelkit.checkpointing.formats.manifest import MEMORY_LAST_SAVE, MEMORY_SNAPSHOT, Manifest
from accelkit.errors import AccelkitError, WrongTypeError, warn_at_user_line

if TYPE_CHECKING:
    from accelkit._accelerator.prepared_objects import PreparedObjects
    from accelkit._accelerator.resume import ResumeCheck
    from accelkit.checkpointing.config import ProjectConfiguration
    from accelkit.training.optim import GradientState

__all__ = ["Checkpointing", "SaveObserver"]

logger = logging.getLogger(__name__)


#: ``torch.nn.Module.load_state_dict``'s keyword arguments, which ``load_state`` forwards.
_MODEL_LOAD_KWARGS = frozenset({"strict", "assign"})


class SaveObserver(Protocol):
    """What registers with the save path (:meth:`Checkpointing.add_observer`): told of every
    ``save_state`` and ``load_state``, and asked why a save is made.

    The accelerator's save decisions (:class:`~accelkit.runtime.saving.SaveDecider`: a save
    restarts the policies' intervals) and its preemption part (the log line and the launcher's
    record of a preemption checkpoint) are the observers.
    """

    def reason(self, steps: int) -> str | None:
        """The manifest's ``reason`` for a save made now at ``steps`` optimizer steps, or
        ``None`` for no opinion (the first observer's answer counts; none: ``"user"``)."""
        ...

    def saved(self, reason: str, path: str, steps: int) -> None:
        """``save_state`` committed (or, in the background, started) ``path``."""
        ...

    def loaded(self, path: str, steps: int, saved: int | None) -> None:
        """``load_state`` restored ``path``, a state of ``steps`` optimizer steps; ``saved``:
        the step of the newest checkpoint of the project that state comes after (``steps`` for
        a checkpoint; for a memory snapshot, the last save before it, ``None`` for none)."""
        ...


class Checkpointing:
    """``save_state``/``load_state`` and friends (see the ``Accelerator`` methods of the same
    names, whose documentation is this class's).

    Args:
        manager: the checkpoint manager (commit protocol, retention, background saves) with
            its tiers composed (the remote tier of ``replicate_to``).
        prepared: the objects ``prepare`` registered; read at each save and load.
        gradient_state: the accumulation state; its step is saved and restored.
        project_configuration: where checkpoints go and how model files are written.
        unwrap_model: peels what ``prepare`` put around a model (for :meth:`save_model`).
        resume: records the resume fingerprint each save writes and compares it at the first
            step after each load; ``None``: checkpoints get no fingerprint.
    """

    def __init__(
        self,
        manager: _ckpt_tiered.TieredCheckpointManager,
        prepared: PreparedObjects,
        gradient_state: GradientState,
        project_configuration: ProjectConfiguration,
        unwrap_model: Callable[[torch.nn.Module], torch.nn.Module],
        resume: ResumeCheck | None = None,
    ) -> None:
        self.manager = manager
        self.resume = resume
        self.prepared = prepared
        self.gradient_state = gradient_state
        self.project_configuration = project_configuration
        self.unwrap_model = unwrap_model
        # The iterations of the loadable checkpoint_<n> found when the run started (main
        # process, automatic naming), until training starts or a load makes them moot.
        self._earlier: list[int] = []
        self._resumed = False

        self.last_path: str | None = None  # the newest checkpoint saved or loaded
        self._observers: tuple[SaveObserver, ...] = ()
        self._around: tuple[Callable[[], contextlib.AbstractContextManager[None]], ...] = ()

    def add_observer(self, observer: SaveObserver) -> None:
        """Tell ``observer`` of every save and load from now on, in the order they were added
        (see :class:`SaveObserver`)."""
        self._observers = (*self._observers, observer)

    def run_inside(self, context: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        """Run every call that blocks on checkpoint files (:meth:`save_state`,
        :meth:`load_state`, :meth:`wait_for_checkpoints`) inside ``context()`` from now on:
        the watchdog's ``not_a_hang`` (the time a save or a load takes is not a step's)."""
        self._around = (*self._around, context)

    @contextlib.contextmanager
    def _blocking(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for context in self._around:
                stack.enter_context(context())
            yield

    def look_for_earlier_checkpoints(self) -> None:
        """Note, on the main process, the project's loadable ``checkpoint_<n>`` (committed or
        Accelerate's) when automatic naming is on: :meth:`before_training` warns about them if
        training starts without a load. Called when the ``Accelerator`` is built."""
        config = self.project_configuration
        if not (config.automatic_checkpoint_naming and config.project_dir):
            return
        if not self.manager.state.is_main_process:
            return
        try:
            infos = loadable_automatic(self.manager.list_checkpoints())
        except (OSError, AccelkitError) as error:  # save_state and load_state report it
            logger.debug("Not looking for earlier checkpoints: %s", error)
            return
        self._earlier = [i.iteration for i in infos if i.iteration is not None]

    def before_training(self) -> None:
        """Warn once, on the main process, when training starts (the first ``backward()``,
        or a ``save_state()`` before any) in a project whose loadable checkpoints would meet
        this run's automatic names, and nothing loaded one: ``iteration`` is still at or below
        theirs, so the first save collides with one of them (``checkpoint_0 already exists``)
        or, older by number, is rotated away by ``total_limit`` at once.
        """
        earlier, self._earlier = self._earlier, []
        if not earlier or self._resumed:
            return
        iteration = self.manager.counter.value
        if iteration > max(earlier):
            return  # the user set iteration past them: a new series after the old one
        root = self.manager.checkpoints_root()
        numbers = sorted(earlier)
        shown = ", ".join(checkpoint_name(n) for n in numbers)
        if len(numbers) > 3:
            shown = f"{checkpoint_name(numbers[0])}, ..., {checkpoint_name(numbers[-1])}"
        newest = checkpoint_name(numbers[-1])
        if iteration in earlier:
            consequence = "which exists already, so that save will fail"
        elif self.project_configuration.total_limit is not None:
            consequence = (
                f"which is numbered below {newest}, so total_limit deletes this run's "
                "checkpoints first, as the oldest"
            )
        else:
            consequence = (
                f"which is numbered below {newest}, the one load_state() would take as the newest"
            )
        warn_at_user_line(
            f"{root} already holds {len(earlier)} checkpoint(s) ({shown}) and training starts "
            f"without loading one: this run's next automatic save is "
            f"{checkpoint_name(iteration)}, {consequence}"
            + ". To resume, call accelerator.load_state() after prepare() (it loads the newest "
            "and numbers the next save past it); to start afresh, give this run a new "
            "project_dir; to keep the old checkpoints and number on, pass "
            f"ProjectConfiguration(iteration={max(earlier) + 1}).",
            UnresumedProjectWarning,
        )

    @property
    def project_dir(self) -> str | None:
        """Root folder (or fsspec URL) for logs and checkpoints."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Folder for trackers' logs."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """Number of the next automatically named checkpoint."""
        return self.manager.counter.value

    def training_objects(self) -> _ckpt_manager.TrainingObjects:
        """A snapshot of what a checkpoint holds: the prepared and the registered objects."""
        return _ckpt_manager.TrainingObjects(
            models=list(self.prepared.models),
            optimizers=list(self.prepared.optimizers),
            schedulers=list(self.prepared.schedulers),
            dataloaders=list(self.prepared.dataloaders),
            scaler=self.prepared.scaler,
            custom=self.manager.custom,
        )

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save models, optimizers, schedulers, scaler, dataloader positions, RNG states and
        registered objects, then commit the checkpoint (see :mod:`accelkit.checkpointing.manager`).

        With ``async_save=True`` (or ``ProjectConfiguration(async_save=True)``) the call only
        copies the state to host memory (one reusable buffer set: one host copy of the saved
        tensors) and returns an :class:`~accelkit.checkpointing.commit.async_save.AsyncCheckpoint`
        (``done()``, ``result()`` -> the path, ``exception()``); a background thread writes and
        commits it, and applies retention after the commit. Training may change every object
        at once. At most one save is in flight: the next ``save_state``, ``load_state``,
        :meth:`wait_for_checkpoints` and :meth:`end_training` wait for it and raise its
        failure (also logged when it happens). Interpreter exit waits for it too.

        The manifest records why the checkpoint was made (``reason``): ``"preemption"`` while
        a preemption signal has not been answered by a save yet, ``"interval"`` when
        ``save_every_steps``/``save_every_seconds`` is due, else ``"user"``; each save restarts
        those intervals (see :meth:`~accelkit.Accelerator.should_save`).

        Unlike the reference, rotation (``total_limit``) runs only after the new checkpoint is
        committed, and states are safetensors + JSON, not pickles (``safe_serialization=False``
        is accepted and ignored). Call it on every process.

        Normally every process passes the same ``output_dir``: one checkpoint, the main process
        commits it. If each process passes a folder of its own (a path naming the process, a
        temporary folder per process), each folder becomes a complete checkpoint of its own:
        every process writes the model, optimizer, scheduler, scaler and dataloader states,
        registered objects and its own random states there and commits it with its own
        manifest (``process_index`` names the writer). ``load_state(that folder)`` on the same
        process restores it exactly; another process is refused (the random states in it are
        the writer's). Refused with a ``CheckpointError`` naming the folders: some processes
        sharing a folder while others do not, and sharded (FSDP) state, which needs one folder
        all processes reach. The reference writes models, optimizers and schedulers into the
        main process's folder only, and each process loads whatever its folder holds.

        Args:
            output_dir: folder or fsspec URL; default ``<project_dir>/checkpoints/checkpoint_<n>``
                with ``automatic_checkpoint_naming``. An explicit ``output_dir`` is always
                used (the reference ignores it under automatic naming).
            safe_serialization: accepted for compatibility; files are always safetensors/JSON.
            async_save: write in the background; ``None`` uses the configuration's default.
            **kwargs: ``metrics`` (numbers for ``keep_best`` retention), ``metadata`` (JSON
                values stored in the manifest), ``max_shard_size`` for model files.

        Returns:
            The checkpoint's path or URL; with ``async_save``, the handle of the save.
        """
        if self._earlier:
            self.before_training()
        step = self.gradient_state.optimizer_steps
        objects = self.training_objects()
        if self.resume is not None:
            objects.fingerprint = self.resume.record()
        reason = next(
            (r for r in (o.reason(step) for o in self._observers) if r is not None), "user"
        )
        with self._blocking():
            result = self.manager.save(
                output_dir, objects, step, async_save=async_save, reason=reason, **kwargs
            )
        path = self.last_path = result if isinstance(result, str) else result.path
        for observer in self._observers:
            observer.saved(reason, path, step)
        return result

    def save_in_flight(self) -> bool:
        """Whether a save is still being written, or failed without its caller being told yet
        (a snapshot started now would wait for it, or raise its failure)."""
        return not self.manager.background.idle()

    def save_snapshot(self, output_dir: str, last_save: int | None) -> AsyncCheckpoint:
        """Start a memory snapshot into ``output_dir`` (this process's own folder): what
        :meth:`save_state` saves, through the asynchronous save, with the resume fingerprint;
        no checkpoint of the project (no observer, no tracker report, no retention). Its
        failure is the caller's (the handle is claimed: see
        :meth:`~accelkit.checkpointing.commit.async_save.AsyncCheckpoint.claim`). Call it on
        every process at the same step boundary. ``last_save``: the step of the run's newest
        checkpoint of the project, recorded for the save decisions of a run restored from it.

        Raises:
            CheckpointError: the save in flight failed, or this one was refused before
                anything was written (on every process alike).
        """
        step = self.gradient_state.optimizer_steps
        objects = self.training_objects()
        if self.resume is not None:
            objects.fingerprint = self.resume.record()
        with self._blocking():
            handle = self.manager.save(
                output_dir,
                objects,
                step,
                async_save=True,
                reason=MEMORY_SNAPSHOT,
                project=False,
                metadata={MEMORY_LAST_SAVE: last_save},
            )
        assert isinstance(handle, AsyncCheckpoint)
        handle.claim()
        return handle

    def register_drain_deadline(self, deadline: Callable[[], float | None]) -> None:
        """How long the end of the run drains the replication queue (see
        :meth:`~accelkit.checkpointing.manager.CheckpointManager.register_drain_deadline`)."""
        self.manager.register_drain_deadline(deadline)

    def close_replication(self, deadline: float | None = None) -> list[str]:
        """Drain the replication queue for up to ``deadline`` seconds and stop it; the names
        of the checkpoints left behind (see
        :meth:`~accelkit.checkpointing.manager.CheckpointManager.close_replication`)."""
        return self.manager.close_replication(deadline)

    def wait_for_checkpoints(self) -> None:
        """Block until the asynchronous save in flight (if any) has committed.

        Raises:
            CheckpointError: a background save failed (raised once; it was not committed).
        """
        with self._blocking():
            self.manager.wait()

    def wait_for_snapshot(self) -> None:
        """Block until the host copy of the last asynchronous save has finished, so that its
        tensors may be changed in place.

        Only needed with ``ProjectConfiguration(async_snapshot="overlapped")``, where
        ``save_state(async_save=True)`` returns before the large parameters and state tensors
        of the prepared optimizers are copied (a background thread copies them during the next
        forward and backward). The prepared optimizer's ``step()``, ``load_state``, the next
        ``save_state``, LocalSGD, ``free_memory``, :meth:`wait_for_checkpoints` and
        ``end_training`` call it themselves; call it before changing parameters or optimizer
        state anywhere else (an EMA swap, a manual ``param.copy_``, a write through
        ``.data``). It does not wait for the files to be written (see
        :meth:`wait_for_checkpoints`) and never raises: a tensor changed too early fails that
        save, reported as any failed asynchronous save.

        Example:
            >>> accelerator.save_state(async_save=True)
            >>> accelerator.wait_for_snapshot()
            >>> ema.copy_to(model.parameters())  # safe: the copy is done
        """
        self.manager.wait_for_snapshot()

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        fork: bool = False,
        **kwargs: Any,
    ) -> str:
        """Restore everything :meth:`save_state` saved, checking sizes and checksums first.

        With no ``input_dir``, loads the newest committed checkpoint under
        ``<project_dir>/checkpoints`` and sets :attr:`save_iteration` past every existing one,
        so the next automatic save continues the numbering (the reference collides).

        Args:
            input_dir: the checkpoint's folder or URL.
            load_kwargs: accepted for compatibility (nothing is unpickled, so it is unused).
            fork: start a new experiment from the checkpoint instead of resuming its run: the
                trackers open new runs that record where they came from (W&B ``fork_from``,
                MLflow's parent run, a ``forked_from`` configuration entry in every backend),
                the checkpoint's runs are left as they are, and every checkpoint this job
                saves records the lineage (``experiment.lineage`` in its manifest, shown by
                ``accelkit ckpt ls --tree``). Call it before the first ``log()``. With
                ``ProjectConfiguration(continue_tracker_runs=False)`` the runs open in
                ``init_trackers``, before the load: only the manifests record the fork.
            **kwargs: ``verify=False`` skips the checksum check this once; the model-loading
                arguments of ``torch.nn.Module.load_state_dict`` (``strict``, ``assign``) go
                to every model's ``load_state_dict``, as in Accelerate (``strict=False``
                loads the keys both sides have; shapes are still checked).

        Returns:
            The path or URL that was loaded.

        Raises:
            TypeError: for any other keyword argument (before anything is loaded).
            UsageError: ``fork=True`` after this run logged (its runs cannot become new
                ones; before anything is loaded).
        """
        unknown = sorted(set(kwargs) - {"verify", *_MODEL_LOAD_KWARGS})
        if unknown:
            raise WrongTypeError(
                f"load_state() got unexpected keyword arguments {unknown}; it takes verify= "
                f"and the model-loading arguments {sorted(_MODEL_LOAD_KWARGS)} (passed to each "
                "model's load_state_dict). Remove the others."
            )
        verify = kwargs.pop("verify", None)
        objects = self.training_objects()
        objects.model_load_kwargs = kwargs
        with self._blocking():
            result = self.manager.load(input_dir, objects, verify=verify, fork=fork)
        self._resumed = True
        # The manifest's step counts optimizer steps. Gradients are not saved, so accumulation
        # restarts at a boundary: a partial accumulation from before the save cannot be resumed.
        self.gradient_state.optimizer_steps = result.manifest.step
        self.gradient_state.micro_step = 0
        self.last_path = result.path
        if self.resume is not None:
            self.resume.expect(result.path, result.fingerprint)
        saved = _last_save(result.manifest)
        for observer in self._observers:
            observer.loaded(result.path, result.manifest.step, saved)
        return result.path

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict``/``load_state_dict``) too."""
        self.manager.register(*objects)

    def register_save_state_pre_hook(
        self, hook: Callable[..., None]
    ) -> torch.utils.hooks.RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in :meth:`save_state` before writing;
        removing an entry of ``weights`` skips saving that model."""
        return self.manager.register_save_pre_hook(hook)

    def register_load_state_pre_hook(
        self, hook: Callable[..., None]
    ) -> torch.utils.hooks.RemovableHandle:
        """``hook(models, input_dir)`` runs in :meth:`load_state` before loading; removing an
        entry of ``models`` skips loading that model."""
        return self.manager.register_load_pre_hook(hook)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``torch.save`` once (or once per machine with ``save_on_each_node``); ``f`` may be a
        path, an fsspec URL or a binary file."""
        self.manager.save_object(obj, f, safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's weights once: safetensors (``pytorch_model.bin`` pickles with
        ``safe_serialization=False``), sharded above ``max_shard_size``; weight files of an
        earlier save that this one does not use are removed."""
        unwrapped = self.unwrap_model(model)
        sharded = _fsdp.is_sharded(unwrapped)
        # A sharded model's full tensors are gathered to the main process (every process
        # takes part), which writes them like any other model's.
        target = _fsdp.gather_full_model(unwrapped) if sharded else unwrapped
        if target is not None and (sharded or self.manager.should_save_object()):
            _ckpt_model_io.save_model(
                target,
                save_directory,
                max_shard_size,
                safe_serialization,
                self.project_configuration.storage_options,
            )
        if sharded:
            self.manager.state.wait_for_everyone()


def _last_save(manifest: Manifest) -> int | None:
    """The step of the newest checkpoint of the project the loaded state comes after: its own
    step, or, for a memory snapshot, what it recorded (untrusted: a number from 0 to its step,
    else none)."""
    if manifest.reason != MEMORY_SNAPSHOT:
        return manifest.step
    value = manifest.metadata.get(MEMORY_LAST_SAVE)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= manifest.step:
        return value
    return None
