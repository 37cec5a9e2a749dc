"""Save, load, list and rotate the checkpoints of one run.

:class:`CheckpointManager` is what ``save_state``/``load_state`` call. A save runs the commit
protocol of :mod:`~accelkit.checkpointing.commit.protocol` (prepare under the project's save lock,
agree, write, exchange, commit, retention, release), either in the caller's thread on the
default process group or, with ``async_save``, through the driver of
:mod:`~accelkit.checkpointing.commit.async_save` (a host snapshot written by a writer thread on its
own gloo group). Retention and ``accelkit ckpt prune`` delete through
:mod:`~accelkit.checkpointing.commit.deletion`.

The run's counter (the number of the next automatic checkpoint) is an
:class:`IterationCounter` the manager owns; users read it as ``ProjectConfiguration.iteration``.

A load runs the load sequence of :mod:`~accelkit.checkpointing.restore.sequence` (resolve,
confine, check, read, agree, apply, counter, meet) with one of two readers plugged in: accelkit's
own (:mod:`~accelkit.checkpointing.restore.native`) or the safe reader of Hugging Face
accelerate's folders (:mod:`~accelkit.checkpointing.interop.accelerate_format`). It reads and
checks every file first, changes the live objects only when all of it is good, and never writes
to storage.

The run's listener (:class:`~accelkit.checkpointing.listener.CheckpointListener`) is called
through :class:`~accelkit.checkpointing.listener.SafeListener`: its failures are logged, never
raised into a save or a load.

The manager knows one tier, ``project_dir``. Further tiers compose with it through
:class:`Tier` (:meth:`CheckpointManager.add_tier`): a commit observer each save may get, what
retention holds back, and the resolve of ``load_state()`` without a folder; the remote tier of
:mod:`~accelkit.checkpointing.tiered` is one.

Public API: :class:`CheckpointManager` (``register``, ``register_save_pre_hook``,
``register_load_pre_hook``, ``add_tier``, ``save``, ``wait``, ``load``, ``list_checkpoints``,
``latest``, ``checkpoints_root``, ``save_object``), :class:`Tier`, :class:`IterationCounter` and
:class:`~accelkit.checkpointing.restore.sequence.LoadResult` (what ``load`` returns).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from accelkit.checkpointing.catalog.listing import (
    ACCELERATE,
    COMMITTED,
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
)
from accelkit.checkpointing.commit.async_save import AsyncCheckpoint, AsyncSaver
from accelkit.checkpointing.commit.deletion import HoldBudget, apply_retention
from accelkit.checkpointing.commit.lock import RunLock
from accelkit.checkpointing.commit.payload import LivePayload, capture_live
from accelkit.checkpointing.commit.protocol import (
    Coordinator,
    DefaultCoordinator,
    SaveRequest,
    SaveSequence,
)
from accelkit.checkpointing.config import ProjectConfiguration
from accelkit.checkpointing.formats.layout import checkpoint_name, checkpoints_dir
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.formats.safetensors_io import write_safetensors
from accelkit.checkpointing.interop.accelerate_format import AccelerateReader
from accelkit.checkpointing.listener import (
    CheckpointListener,
    CommitReport,
    LoadReport,
    SafeListener,
)
from accelkit.checkpointing.objects.contents import TrainingObjects, unwrap_model
from accelkit.checkpointing.restore.native import NativeReader
from accelkit.checkpointing.restore.sequence import LoadResult, LoadSequence
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.checkpointing.storage.retry import with_retries
from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.fsdp.runtime import is_sharded

__all__ = [
    "CheckpointManager",
    "IterationCounter",
    "LoadResult",
    "ProcessInfo",
    "Tier",
    "TrainingObjects",
]


logger = logging.getLogger(__name__)


class ProcessInfo(Protocol):
    """What the manager needs to know about this process
    (``accelkit.runtime.state.PartialState``)."""

    @property
    def process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    def wait_for_everyone(self) -> None: ...


#: What a :class:`Tier` may run on the main process after a save's commit and retention: the
#: committed folder and its manifest.
CommitObserver = Callable[[str, Manifest], None]


class Tier(Protocol):
    """A further tier composed with the manager's own (``project_dir``), e.g. the remote tier
    of :mod:`~accelkit.checkpointing.tiered`. The manager calls it at three
    points and knows nothing else of it; its failures are the caller's (save or load)."""

    def observer(self, automatic: bool) -> CommitObserver | None:
        """Called on every process as a save starts (``automatic``: an automatically named
        checkpoint); what it returns runs on the main process after the commit and the
        retention."""
        ...

    def hold(self) -> tuple[Collection[str], HoldBudget | None]:
        """At retention (main process, after a commit): the paths local retention must keep
        although its rules would delete them, and the byte budget of those (``None``: none;
        see :class:`~accelkit.checkpointing.commit.deletion.HoldBudget`)."""
        ...

    def resolve(
        self, sequence: LoadSequence, objects: TrainingObjects, local: Callable[[], LoadResult]
    ) -> LoadResult:
        """``load_state()`` without a folder, on every process: load through ``sequence``
        (:meth:`~accelkit.checkpointing.restore.sequence.LoadSequence.run` with a folder of
        this tier), or return ``local()``, the resolve of the tiers below."""
        ...


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


def _pretty_name(obj: Any) -> str:
    """The name a user knows ``obj`` by: its own for a class or function, else its class's."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return str(named.__qualname__)


class CheckpointManager:
    """Everything ``save_state``/``load_state`` do, for one run.

    Args:
        config: the run's :class:`~accelkit.checkpointing.ProjectConfiguration`.
        state: this process's identity (an ``accelkit.runtime.state.PartialState``).
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
        self.background = AsyncSaver(
            writer=config.async_writer, snapshot_mode=config.async_snapshot
        )
        self.listener: CheckpointListener | None = None
        self.tiers: list[Tier] = []
        """The tiers composed with this one (:meth:`add_tier`)."""

    # ------------------------------------------------------------------ registration

    def register(self, *objects: Any) -> None:
        """Add objects to save and restore with every checkpoint.

        Raises:
            ValueError: listing each object (its position and type) that lacks a callable
                ``state_dict`` or ``load_state_dict``; Accelerate raises ``ValueError`` here too.
        """
        bad = [
            (index, obj)
            for index, obj in enumerate(objects)
            if not callable(getattr(obj, "state_dict", None))
            or not callable(getattr(obj, "load_state_dict", None))
        ]
        if bad:
            items = "".join(
                f"\n\t- Item at index {index}, `{_pretty_name(obj)}` ({obj!r:.60})"
                for index, obj in bad
            )
            raise ConfigurationError(
                "register_for_checkpointing needs objects with state_dict() and "
                "load_state_dict() methods; add both to the class of each of these inputs, "
                f"or leave it out:{items}"
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

    def add_tier(self, tier: Tier) -> None:
        """Compose ``tier`` with this one (see :class:`Tier`); a tier added later resolves
        loads first."""
        self.tiers.append(tier)

    # ------------------------------------------------------------------ locations

    def storage(self, url: str) -> Storage:
        """The storage of ``url``, with the configuration's storage options; an object store's
        transient errors are retried for up to ``storage_retry_seconds`` per operation."""
        storage = get_storage(url, self.config.storage_options)
        return with_retries(storage, self.config.storage_retry_seconds)

    def checkpoints_root(self) -> str:
        """``<project_dir>/checkpoints``.

        Raises:
            ValueError: if no ``project_dir`` is set.
        """
        if not self.config.project_dir:
            raise ConfigurationError(
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
            raise ConfigurationError(
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
        reason: str = "user",
        project: bool = True,
    ) -> str | AsyncCheckpoint:
        """Write a checkpoint of ``objects`` and commit it (see
        :mod:`~accelkit.checkpointing.commit.protocol`); must be called on every process.

        Waits for the asynchronous save in flight first and raises its failure.

        Args:
            async_save: copy the state to host memory and write it in a writer thread,
                returning an :class:`~accelkit.checkpointing.commit.async_save.AsyncCheckpoint`;
                ``None`` uses ``ProjectConfiguration.async_save``.
            reason: why it is made, recorded in the manifest (``"user"``, ``"interval"``,
                ``"preemption"``, ``"memory"``).
            project: a checkpoint of the project: the listener is told of its commit and the
                run's counter moves past it. ``False``: a memory snapshot (neither; its
                manifest still names the run's trackers).

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
        listener = self._listener() if self.state.is_main_process else None
        request = SaveRequest(
            target=target,
            automatic=automatic,
            iteration=self.counter.value,
            step=int(step),
            metrics={str(k): float(v) for k, v in (metrics or {}).items()},
            metadata=dict(metadata or {}),
            max_shard_size=max_shard_size,
            experiment=listener.checkpoint_record() if listener else {},
            sharded=any(is_sharded(unwrap_model(m)) for m in objects.models),
            total_limit=self.config.total_limit,
            reason=reason,
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
            on_commit=self._on_commit(
                listener if project else None, started, bool(async_save), automatic
            ),
        )
        try:
            sequence.prepare()
        finally:
            # Past the number used (spent whatever happens next: a failed automatic folder is
            # removed), or past a folder that took it (see protocol); unchanged if refused
            # otherwise (the lock of another run).
            if project:
                self.counter.set(sequence.next_iteration)
        target = sequence.target  # the main process may have moved past an imported folder
        rank, main = self.state.process_index, self.state.is_main_process
        main = main or sequence.per_process  # a folder of its own: it writes everything
        hooks = list(self._save_hooks.values())

        def take() -> LivePayload:
            return capture_live(objects, hooks, target, rank, main)

        if async_save:
            self.background.writer = self.config.async_writer
            self.background.snapshot_mode = self.config.async_snapshot
            return self.background.start(sequence, take, guard=objects.optimizers)
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

    def wait_for_snapshot(self) -> None:
        """Block until the background copy of an overlapped asynchronous save (if any) has
        finished (``ProjectConfiguration.async_snapshot="overlapped"``); never raises."""
        self.background.wait_for_snapshot()

    def _run_lock(self) -> RunLock:
        """The project's save lock (see :mod:`~accelkit.checkpointing.commit.lock`): a save of
        another live process into the same project_dir is refused."""
        project = self.config.project_dir
        assert project is not None  # automatic naming has a project_dir
        if self._lock is None or self._lock.root != project:
            self._lock = RunLock(self.storage(project), project)
        return self._lock

    def _retain(self, committed: str) -> None:
        root = self.checkpoints_root()
        protect: set[str] = set()
        budget: HoldBudget | None = None
        for tier in self.tiers:
            held, limit = tier.hold()
            protect.update(held)
            if budget is None:  # one budget: the first tier's that has one
                budget = limit
        policy = self.config.retention_policy()
        apply_retention(
            self.storage(root), root, policy, committed, protect, budget, now=time.time()
        )

    def _on_commit(
        self, listener: SafeListener | None, started: float, asynchronous: bool, automatic: bool
    ) -> Callable[[SaveSequence], None] | None:
        """What the main process runs after a commit: report it, then the tiers' observers."""
        report = _reporter(listener, started, asynchronous) if listener else None
        observers = [o for o in (t.observer(automatic) for t in self.tiers) if o is not None]
        if report is None and not observers:
            return None

        def after(sequence: SaveSequence) -> None:
            if report is not None:
                report(sequence)
            if sequence.manifest is not None:
                for observer in observers:
                    observer(sequence.target, sequence.manifest)

        return after

    # ------------------------------------------------------------------ loading

    def load(
        self,
        input_dir: str | os.PathLike[str] | None,
        objects: TrainingObjects,
        verify: bool | None = None,
        fork: bool = False,
    ) -> LoadResult:
        """Restore ``objects`` from a committed checkpoint; must be called on every process.

        ``fork`` is handed to the listener (:attr:`LoadReport.fork
        <accelkit.checkpointing.listener.LoadReport.fork>`), which asked first, through its
        optional ``check_fork()``, whether it can fork now (it raises if not, before anything
        is read).

        Runs the load sequence of :mod:`~accelkit.checkpointing.restore.sequence`, with
        accelkit's reader for its own checkpoints and the safe reader of
        :mod:`~accelkit.checkpointing.interop.accelerate_format` for folders Hugging Face
        accelerate wrote. Waits for the asynchronous save in flight first (and raises its
        failure).

        With ``input_dir=None``, the newest committed checkpoint under ``project_dir`` that
        loads: one whose files fail their checks is skipped with a warning naming it and why
        (it is never deleted), and the next older one is tried. With a path, that checkpoint
        or an error. Sets ``config.iteration`` past the loaded checkpoint and past every
        ``checkpoint_<n>`` folder under ``project_dir``, so the next automatic save never
        collides.

        Raises:
            CheckpointError: the folder is not a committed checkpoint (the message says what
                it is and what to pass instead).
            CorruptCheckpointError / CheckpointMismatchError: see
                :func:`~accelkit.checkpointing.objects.contents.read_contents`. Nothing is
                changed then.
        """
        started = time.perf_counter()
        check_fork = getattr(self.listener, "check_fork", None)
        if fork and check_fork is not None:
            check_fork()
        self.wait()
        path = None if input_dir is None else os.fspath(input_dir)
        # Without a folder to load, the project's checkpoints are needed (this raises when no
        # project_dir is set); with one, they only move the counter past their numbers.
        root = self.checkpoints_root() if path is None or self.config.project_dir else None
        sequence = LoadSequence(
            self.state,
            self.storage,
            {COMMITTED: NativeReader, ACCELERATE: AccelerateReader},
            self.counter,
            root=root,
            hooks=list(self._load_hooks.values()),
            verify=self.config.verify_checksums if verify is None else verify,
        )
        result = (
            sequence.run(path, objects) if path is not None else self._resolve(sequence, objects)
        )
        listener = self._listener()
        if listener is not None:
            seconds = time.perf_counter() - started
            report = LoadReport(result.path, result.manifest, seconds, fork, result.tier)
            listener.checkpoint_loaded(report)
        return result

    def _resolve(self, sequence: LoadSequence, objects: TrainingObjects) -> LoadResult:
        """``load_state()`` without a folder: through the tiers, the last added first, down to
        this one (the newest committed checkpoint under ``project_dir`` that loads)."""

        def local() -> LoadResult:
            return dataclasses.replace(sequence.run(None, objects), tier="local")

        load = local
        for tier in self.tiers:
            load = _through(tier, sequence, objects, load)
        return load()

    def _listener(self) -> SafeListener | None:
        """:attr:`listener`, its failures logged instead of raised into a save or load."""
        return None if self.listener is None else SafeListener(self.listener)

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
            raise WrongTypeError(
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


def _through(
    tier: Tier, sequence: LoadSequence, objects: TrainingObjects, below: Callable[[], LoadResult]
) -> Callable[[], LoadResult]:
    """The resolve of ``tier`` over the tiers ``below`` it."""
    return lambda: tier.resolve(sequence, objects, below)


def _reporter(
    listener: SafeListener, started: float, asynchronous: bool
) -> Callable[[SaveSequence], None]:
    """The ``on_commit`` of a save: report it to ``listener`` with its timings."""

    def report(sequence: SaveSequence) -> None:
        assert sequence.manifest is not None
        seconds = time.perf_counter() - started
        blocking = sequence.captured_at - started if asynchronous else seconds
        commit = CommitReport(sequence.target, sequence.manifest, seconds, blocking, asynchronous)
        listener.checkpoint_committed(commit)

    return report
