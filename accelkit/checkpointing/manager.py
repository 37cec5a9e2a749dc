"""Save, load, list and rotate the checkpoints of one run.

:class:`CheckpointManager` is what ``save_state``/``load_state`` call. A save runs the commit
protocol of :mod:`~accelkit.checkpointing.protocol` (prepare under the project's save lock,
agree, write, exchange, commit, retention, release), either in the caller's thread on the
default process group or, with ``async_save``, through the driver of
:mod:`~accelkit.checkpointing.async_save` (a host snapshot written by a writer thread on its
own gloo group). Retention and ``accelkit ckpt prune`` delete through
:mod:`~accelkit.checkpointing.deletion`.

The run's counter (the number of the next automatic checkpoint) is an
:class:`IterationCounter` the manager owns; users read it as ``ProjectConfiguration.iteration``.

Loading reads and checks every file first and changes the live objects only when all of it is
good; it never writes to storage.

Public API: :class:`CheckpointManager` (``register``, ``register_save_pre_hook``,
``register_load_pre_hook``, ``save``, ``wait``, ``load``, ``list_checkpoints``, ``latest``,
``checkpoints_root``, ``save_object``), :class:`IterationCounter` and :class:`LoadResult`.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from accelkit._text import clip
from accelkit.checkpointing.accelerate_format import load_accelerate
from accelkit.checkpointing.async_save import AsyncCheckpoint, AsyncSaver
from accelkit.checkpointing.catalog import (
    ACCELERATE,
    CORRUPT,
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    loadable_automatic,
    next_iteration,
)
from accelkit.checkpointing.config import ProjectConfiguration
from accelkit.checkpointing.contents import (
    TrainingObjects,
    apply_contents,
    read_contents,
    unwrap_model,
)
from accelkit.checkpointing.deletion import apply_retention
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.formats.layout import checkpoint_name, checkpoints_dir
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.formats.safetensors_io import write_safetensors
from accelkit.checkpointing.listener import CheckpointListener, CommitReport, LoadReport
from accelkit.checkpointing.loading import agree_on_load
from accelkit.checkpointing.lock import RunLock
from accelkit.checkpointing.payload import LivePayload, capture_live
from accelkit.checkpointing.per_process import check_loadable_here
from accelkit.checkpointing.protocol import (
    Coordinator,
    DefaultCoordinator,
    SaveRequest,
    SaveSequence,
)
from accelkit.checkpointing.sharded import check_load_compatible, load_sharded, sharded_targets
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.checkpointing.storage.confined import confine
from accelkit.fsdp import is_sharded

__all__ = [
    "CheckpointManager",
    "IterationCounter",
    "LoadResult",
    "ProcessInfo",
    "TrainingObjects",
]

logger = logging.getLogger(__name__)


class ProcessInfo(Protocol):
    """What the manager needs to know about this process (``accelkit.state.PartialState``)."""

    @property
    def process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    def wait_for_everyone(self) -> None: ...


@dataclass(frozen=True)
class LoadResult:
    """What :meth:`CheckpointManager.load` loaded."""

    path: str
    manifest: Manifest


def _warn_damaged(path: str, why: str | None) -> None:
    logger.warning(
        "Not resuming from %s: it is damaged (%s). Resuming from the newest older checkpoint "
        "that loads; the damaged one is left in place (`accelkit ckpt verify` shows it).",
        clip(path, 1000),
        clip(why or "", 2000),  # the reason quotes the checkpoint's own names and may be huge
    )


class IterationCounter:
    """The number of the next automatic checkpoint: the run's counter, owned by its
    :class:`CheckpointManager`.

    Users read it (and may set it) as ``ProjectConfiguration.iteration``, as Accelerate
    documents: :meth:`set` is the one place that writes that field, and :attr:`value` adopts a
    number the user wrote there since.
    """

    def __init__(self, config: ProjectConfiguration) -> None:
        self._config = config
        self._value = config.iteration

    @property
    def value(self) -> int:
        """The number the next automatic save uses."""
        shown = self._config.iteration
        if shown != self._value:  # set by the user since: theirs wins
            self._value = shown
        return self._value

    def set(self, value: int) -> None:
        """Make ``value`` the next number (and show it in the configuration)."""
        self._value = value
        self._config.iteration = value


class CheckpointManager:
    """Everything ``save_state``/``load_state`` do, for one run.

    Args:
        config: the run's :class:`~accelkit.checkpointing.ProjectConfiguration`.
        state: this process's identity (an ``accelkit.state.PartialState``).
    """

    def __init__(self, config: ProjectConfiguration, state: ProcessInfo) -> None:
        self.config = config
        self.state = state
        self.custom: list[Any] = []
        # OrderedDict, not dict: RemovableHandle keeps a weak reference to it.
        self._save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._lock: RunLock | None = None
        self.counter = IterationCounter(config)
        self.background = AsyncSaver()
        self.listener: CheckpointListener | None = None

    # ------------------------------------------------------------------ registration

    def register(self, *objects: Any) -> None:
        """Add objects to save and restore with every checkpoint.

        Raises:
            TypeError: naming the object, if one lacks ``state_dict`` or ``load_state_dict``.
        """
        bad = [
            obj
            for obj in objects
            if not callable(getattr(obj, "state_dict", None))
            or not callable(getattr(obj, "load_state_dict", None))
        ]
        if bad:
            names = ", ".join(f"{type(o).__name__} ({o!r:.60})" for o in bad)
            raise TypeError(
                f"register_for_checkpointing needs objects with state_dict() and "
                f"load_state_dict(); these lack them: {names}. Add both methods to the class."
            )
        self.custom.extend(objects)

    def register_save_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs before the files are written."""
        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def register_load_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs before anything is loaded."""
        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------------ locations

    def storage(self, url: str) -> Storage:
        """The storage of ``url``, with the configuration's storage options."""
        return get_storage(url, self.config.storage_options)

    def checkpoints_root(self) -> str:
        """``<project_dir>/checkpoints``.

        Raises:
            ValueError: if no ``project_dir`` is set.
        """
        if not self.config.project_dir:
            raise ValueError(
                "No project_dir is set, so there is no checkpoints folder: pass "
                "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...), or "
                "give the checkpoint's path explicitly."
            )
        return checkpoints_dir(self.config.project_dir)

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint under ``<project_dir>/checkpoints``, oldest first."""
        root = self.checkpoints_root()
        return list_checkpoints(self.storage(root), root)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed ``checkpoint_<n>``, or ``None``."""
        root = self.checkpoints_root()
        return latest_checkpoint(self.storage(root), root)

    def _output_dir(self, output_dir: str | os.PathLike[str] | None) -> tuple[str, bool]:
        if output_dir is not None:
            return os.fspath(output_dir), False
        if not self.config.automatic_checkpoint_naming:
            raise ValueError(
                "save_state() needs an output_dir, or automatic naming: "
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)."
            )
        root = self.checkpoints_root()
        return join(root, checkpoint_name(self.counter.value)), True

    # ------------------------------------------------------------------ saving

    def save(
        self,
        output_dir: str | os.PathLike[str] | None,
        objects: TrainingObjects,
        step: int = 0,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_shard_size: int | str = "10GB",
        async_save: bool | None = None,
    ) -> str | AsyncCheckpoint:
        """Write a checkpoint of ``objects`` and commit it (see
        :mod:`~accelkit.checkpointing.protocol`); must be called on every process.

        Waits for the asynchronous save in flight first and raises its failure.

        Args:
            async_save: copy the state to host memory and write it in a writer thread,
                returning an :class:`~accelkit.checkpointing.async_save.AsyncCheckpoint`;
                ``None`` uses ``ProjectConfiguration.async_save``.

        Returns:
            The checkpoint's path or URL; with ``async_save``, the handle of the save.

        Raises:
            CheckpointError: the previous asynchronous save failed, the automatic folder
                already exists (the next save then uses the next free number; one written by
                ``accelkit ckpt import`` is skipped without an error), or any process failed;
                the checkpoint is then not committed.
        """
        started = time.perf_counter()
        self.wait()
        if async_save is None:
            async_save = bool(self.config.async_save)
        target, automatic = self._output_dir(output_dir)
        listener = self.listener if self.state.is_main_process else None
        request = SaveRequest(
            target=target,
            automatic=automatic,
            iteration=self.counter.value,
            step=int(step),
            metrics={str(k): float(v) for k, v in (metrics or {}).items()},
            metadata=dict(metadata or {}),
            max_shard_size=max_shard_size,
            experiment=_ask(listener, "checkpoint_record", {}) if listener else {},
            sharded=any(is_sharded(unwrap_model(m)) for m in objects.models),
        )
        if async_save:
            coordinator: Coordinator = self.background.coordinator(self.state)
        else:
            coordinator = DefaultCoordinator(self.state)
        sequence = SaveSequence(
            coordinator,
            self.storage(target),
            request,
            lock=self._run_lock() if automatic else None,
            retention=self._retain,
            label="Asynchronous save of" if async_save else "Saving",
            on_commit=_reporter(listener, started, bool(async_save)) if listener else None,
        )
        try:
            sequence.prepare()
        finally:
            # Past the number used (spent whatever happens next: a failed automatic folder is
            # removed), or past a folder that took it (see protocol); unchanged if refused
            # otherwise (the lock of another run).
            self.counter.set(sequence.next_iteration)
        target = sequence.target  # the main process may have moved past an imported folder
        rank, main = self.state.process_index, self.state.is_main_process
        main = main or sequence.per_process  # a folder of its own: it writes everything
        hooks = list(self._save_hooks.values())

        def take() -> LivePayload:
            return capture_live(objects, hooks, target, rank, main)

        if async_save:
            return self.background.start(sequence, take)
        sequence.capture(take)
        sequence.finish()
        return target

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) has finished; raise its
        failure unless the caller already got it from the handle.

        Raises:
            CheckpointError: it failed; it was not committed.
        """
        self.background.wait()

    def _run_lock(self) -> RunLock:
        """The project's save lock (see :mod:`~accelkit.checkpointing.lock`): a save of
        another live process into the same project_dir is refused."""
        project = self.config.project_dir
        assert project is not None  # automatic naming has a project_dir
        if self._lock is None or self._lock.root != project:
            self._lock = RunLock(self.storage(project), project)
        return self._lock

    def _retain(self, committed: str) -> None:
        root = self.checkpoints_root()
        apply_retention(self.storage(root), root, self.config.retention_policy(), committed)

    # ------------------------------------------------------------------ loading

    def resolve_input_dir(self, input_dir: str | os.PathLike[str] | None) -> str:
        """``input_dir``, or the newest committed checkpoint under ``project_dir``."""
        if input_dir is not None:
            return os.fspath(input_dir)
        return self._committed_newest_first()[0].path

    def _committed_newest_first(self) -> list[CheckpointInfo]:
        root = self.checkpoints_root()
        storage = self.storage(root)
        infos = list_checkpoints(storage, root)
        committed = loadable_automatic(infos)  # Accelerate's checkpoint_<n> folders count too
        if not committed:
            # A run killed inside its first save left checkpoint_<n> folders: the next
            # automatic save must not collide with them.
            self.counter.set(max(self.counter.value, next_iteration(infos)))
            others = ", ".join(f"{i.name} ({i.state})" for i in infos) or "nothing"
            raise CheckpointError(
                f"No committed checkpoint under {root} (found: {others}). Save one with "
                "save_state() first, or pass the checkpoint's path to load_state()."
            )
        newest = committed[-1].iteration or 0
        for info in infos:
            if info.state == CORRUPT and info.is_automatic and (info.iteration or 0) > newest:
                _warn_damaged(info.path, info.error)
        return committed[::-1]

    def load(
        self,
        input_dir: str | os.PathLike[str] | None,
        objects: TrainingObjects,
        verify: bool | None = None,
    ) -> LoadResult:
        """Restore ``objects`` from a committed checkpoint; must be called on every process.

        Waits for the asynchronous save in flight first (and raises its failure).

        With ``input_dir=None``, the newest committed checkpoint under ``project_dir`` that
        loads: one whose files fail their checks is skipped with a warning naming it and why
        (it is never deleted), and the next older one is tried. With a path, that checkpoint
        or an error. Sets ``config.iteration`` past the loaded checkpoint and past every
        ``checkpoint_<n>`` folder under ``project_dir``, so the next automatic save never
        collides.

        Raises:
            CheckpointError: the folder is not a committed checkpoint (the message says what
                it is and what to pass instead).
            CorruptCheckpointError / CheckpointMismatchError: see :func:`~accelkit.
                checkpointing.contents.read_contents`. Nothing is changed then.
        """
        started = time.perf_counter()
        self.wait()
        if input_dir is not None:
            return self._loaded(self._load_from(os.fspath(input_dir), objects, verify), started)
        candidates = self._committed_newest_first()
        skipped: list[str] = []
        for info in candidates:
            try:
                return self._loaded(self._load_from(info.path, objects, verify), started)
            except CorruptCheckpointError as exc:
                skipped.append(f"{info.name}: {exc}")
                _warn_damaged(info.path, str(exc))
        raise CorruptCheckpointError(
            f"Every committed checkpoint under {self.checkpoints_root()} is damaged; nothing "
            f"was restored: {' | '.join(skipped)}"
        )

    def _loaded(self, result: LoadResult, started: float) -> LoadResult:
        if self.listener is not None:
            seconds = time.perf_counter() - started
            report = LoadReport(result.path, result.manifest, seconds)
            _ask(self.listener, "checkpoint_loaded", None, report)
        return result

    def _load_from(self, path: str, objects: TrainingObjects, verify: bool | None) -> LoadResult:
        storage = confine(self.storage(path), path)
        # Agreed: the processes may load different folders (per-process checkpoints).
        info = check_loadable_here(storage, path, self.state.process_index)
        if info.state == ACCELERATE:  # written by Hugging Face accelerate: read safely
            return self._load_accelerate(storage, path, objects, info)
        manifest = info.manifest
        assert manifest is not None
        targets = sharded_targets(objects.models, objects.optimizers)
        check_load_compatible(storage, path, targets)
        if manifest.world_size != self.state.num_processes and not targets:
            # Weights and optimizer states are the same on every process; only the random
            # states are per process. Those of processes the saving run did not have are
            # seeded from (step, iteration, rank) instead: deterministic, but not the
            # continuation an equal process count gives.
            logger.warning(
                "%s was saved by %d process(es) and this run has %d: processes without saved "
                "random states are seeded deterministically, and a mid-epoch dataloader "
                "position refers to the old process count. Resume with --num_processes %d for "
                "an exact continuation.",
                path,
                manifest.world_size,
                self.state.num_processes,
                manifest.world_size,
            )
        models = list(objects.models)
        for hook in list(self._load_hooks.values()):
            hook(models, path)
        objects = dataclasses.replace(objects, models=models)
        verify = self.config.verify_checksums if verify is None else verify
        plain = targets.remaining(objects)
        error: CheckpointError | None = None
        try:
            loaded = read_contents(storage, path, manifest, plain, self.state.process_index, verify)
        except CheckpointError as exc:
            error = exc
        agree_on_load(error, path)
        if targets:  # a collective; DCP reshards to this run's process count
            load_sharded(storage, path, targets, manifest, verify)
        apply_contents(loaded, plain)
        self.counter.set(self._next_iteration(info))
        # Every process lists the folder before any of them can start the next save (whose
        # new folder would otherwise push one process's numbering past the others').
        self.state.wait_for_everyone()
        return LoadResult(path, manifest)

    def _load_accelerate(
        self, storage: Storage, path: str, objects: TrainingObjects, info: CheckpointInfo
    ) -> LoadResult:
        models = list(objects.models)
        for hook in list(self._load_hooks.values()):
            hook(models, path)
        objects = dataclasses.replace(objects, models=models)
        manifest = load_accelerate(storage, path, objects, self.state)
        self.config.iteration = self._next_iteration(info)
        self.state.wait_for_everyone()
        return LoadResult(path, manifest)

    def _next_iteration(self, info: CheckpointInfo) -> int:
        candidates = [0 if info.iteration is None else info.iteration + 1]
        if self.config.project_dir:
            root = self.checkpoints_root()
            candidates.append(next_iteration(list_checkpoints(self.storage(root), root)))
        return max(candidates)

    # ------------------------------------------------------------------ Accelerator.save

    def should_save_object(self) -> bool:
        """Whether this process writes in ``Accelerator.save`` (once, or once per machine)."""
        if self.config.save_on_each_node:
            return self.state.is_local_main_process
        return self.state.is_main_process

    def save_object(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``Accelerator.save``: write ``obj`` to ``f`` (a path, URL or binary file) on the
        processes :meth:`should_save_object` selects.

        With ``safe_serialization``, ``obj`` must be a ``dict`` of tensors (written as
        safetensors); otherwise it is written with ``torch.save``.
        """
        if not self.should_save_object():
            return
        if safe_serialization and (
            not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values())
        ):
            raise TypeError(
                "save(..., safe_serialization=True) takes a dict of tensors (a state_dict); "
                f"got {type(obj).__name__}. Pass safe_serialization=False for other objects."
            )
        if isinstance(f, (str, os.PathLike)):
            url = os.fspath(f)
            storage = self.storage(url)
            parent = url.rstrip("/").rpartition("/")[0]
            if parent:
                storage.makedirs(parent)
            if safe_serialization:
                write_safetensors(storage, url, obj, {"format": "pt"})
            else:
                buffer = io.BytesIO()
                torch.save(obj, buffer)
                storage.write_bytes(url, buffer.getbuffer())
            return
        if safe_serialization:
            from safetensors.torch import save as safetensors_save

            f.write(safetensors_save(obj, metadata={"format": "pt"}))
        else:
            torch.save(obj, f)


def _ask(listener: CheckpointListener, method: str, default: Any, *args: Any) -> Any:
    """Call a listener method; a failure is logged, never raised into a save or load."""
    try:
        return getattr(listener, method)(*args)
    except Exception:
        logger.warning("Checkpoint listener %s failed:", method, exc_info=True)
        return default


def _reporter(
    listener: CheckpointListener, started: float, asynchronous: bool
) -> Callable[[SaveSequence], None]:
    """The ``on_commit`` of a save: report it to ``listener`` with its timings."""

    def report(sequence: SaveSequence) -> None:
        assert sequence.manifest is not None
        seconds = time.perf_counter() - started
        blocking = sequence.captured_at - started if asynchronous else seconds
        commit = CommitReport(sequence.target, sequence.manifest, seconds, blocking, asynchronous)
        _ask(listener, "checkpoint_committed", None, commit)

    return report
