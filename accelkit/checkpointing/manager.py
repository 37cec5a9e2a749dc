"""Save, load, list and rotate checkpoints with the commit protocol.

The protocol, the same on every storage:

1. The main process prepares the folder: for an automatic save it takes the project's save
   lock (:mod:`~accelkit.checkpointing.lock`, given back after step 4), and
   ``checkpoint_<n>`` must not exist yet;
   an explicit folder that holds a manifest is first un-committed (manifest removed).
2. Every process writes its files (the main process the shared ones, each process its
   ``random_states_<rank>``), then all exchange the list of what they wrote (a barrier).
3. If every process succeeded, the main process removes files of an earlier save that this
   one did not write, and writes ``accelkit.json`` last (atomically): the commit.
4. Only after the commit, and only on the main process, retention deletes old committed
   ``checkpoint_<n>`` folders (manifest first, so a crash leaves an incomplete folder, never a
   corrupt committed one).

Loading reads and checks every file first and changes the live objects only when all of it is
good; it never writes to storage.

Public API: :class:`CheckpointManager` (``register``, ``register_save_pre_hook``,
``register_load_pre_hook``, ``save``, ``load``, ``list_checkpoints``, ``latest``,
``checkpoints_root``, ``save_object``) and :class:`LoadResult`.
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

from accelkit import ops
from accelkit.checkpointing.accelerate_format import load_accelerate
from accelkit.checkpointing.catalog import (
    ACCELERATE,
    CORRUPT,
    CheckpointInfo,
    committed_automatic,
    latest_checkpoint,
    list_checkpoints,
    loadable_automatic,
    next_iteration,
)
from accelkit.checkpointing.checksum import DEFAULT_ALGORITHM
from accelkit.checkpointing.config import ProjectConfiguration
from accelkit.checkpointing.confined import confine
from accelkit.checkpointing.contents import (
    TrainingObjects,
    apply_contents,
    read_contents,
    unwrap_model,
    write_contents,
)
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.layout import (
    MANIFEST_NAME,
    SAVE_MARKER_NAME,
    checkpoint_name,
    checkpoints_dir,
    is_state_file,
)
from accelkit.checkpointing.loading import agree_on_load, check_loadable
from accelkit.checkpointing.lock import RunLock
from accelkit.checkpointing.manifest import (
    FileEntry,
    Manifest,
    file_checksum,
    read_manifest,
    write_manifest,
)
from accelkit.checkpointing.retention import select_for_deletion
from accelkit.checkpointing.safetensors_io import write_safetensors
from accelkit.checkpointing.sharded import (
    check_load_compatible,
    load_sharded,
    save_sharded,
    sharded_targets,
)
from accelkit.checkpointing.storage import Storage, get_storage, join, sync_batch

__all__ = ["CheckpointManager", "LoadResult", "ProcessInfo", "TrainingObjects"]

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
        path,
        why,
    )


def _save_marker() -> bytes:
    import json
    import socket

    doc = {"format": "accelkit-save", "started": time.time(), "host": socket.gethostname()}
    return json.dumps({**doc, "pid": os.getpid()}).encode()


def _agree(error: BaseException | None, what: str) -> None:
    """Share one failure flag across processes; every process raises if any failed."""
    flags = ops.gather_object([None if error is None else f"{type(error).__name__}: {error}"])
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:  # a storage error: say what failed, where, and that nothing committed
        raise CheckpointError(
            f"{what} failed: {type(error).__name__}: {error}. Nothing was committed; earlier "
            "checkpoints are untouched."
        ) from error
    failed = [(rank, msg) for rank, msg in enumerate(flags) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"{what} failed on process {rank}: {msg}")


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
        self._run_lock: RunLock | None = None

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
        return join(root, checkpoint_name(self.config.iteration)), True

    # ------------------------------------------------------------------ saving

    def save(
        self,
        output_dir: str | os.PathLike[str] | None,
        objects: TrainingObjects,
        step: int = 0,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_shard_size: int | str = "10GB",
    ) -> str:
        """Write a checkpoint of ``objects`` and commit it; returns its path/URL.

        Must be called on every process. See the module docstring for the protocol.

        Raises:
            CheckpointError: if the automatic folder already exists or any process failed; the
                checkpoint is then not committed.
        """
        target, automatic = self._output_dir(output_dir)
        storage = self.storage(target)
        iteration = self.config.iteration
        main = self.state.is_main_process
        metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        error: BaseException | None = None
        try:
            if main:
                try:
                    if automatic:
                        self._hold_run_lock()
                    self._prepare_folder(storage, target, automatic)
                except Exception as exc:
                    error = exc
            _agree(error, f"Preparing {target}")
            try:
                self._write_and_commit(
                    storage, target, objects, iteration, step, metrics, metadata, max_shard_size
                )
            except BaseException:
                if automatic:
                    # The folder name is spent: the next automatic save uses the next number,
                    # and the main process removes the uncommitted folder if the storage lets it.
                    self.config.iteration = iteration + 1
                    if main:
                        self._discard(storage, target)
                raise
            if main and automatic:
                self._apply_retention(storage, target)
        finally:
            if main and automatic:
                self._release_run_lock()
        self.config.iteration = iteration + 1
        self.state.wait_for_everyone()
        return target

    def _write_and_commit(
        self,
        storage: Storage,
        target: str,
        objects: TrainingObjects,
        iteration: int,
        step: int,
        metrics: dict[str, float],
        metadata: Mapping[str, Any] | None,
        max_shard_size: int | str,
    ) -> None:
        main = self.state.is_main_process
        written: dict[str, Any] = {}
        error: BaseException | None = None
        sharded_entries: list[FileEntry] = []
        try:
            targets = sharded_targets(objects.models, objects.optimizers)
            if targets:  # FSDP: every process writes its shards (a collective), then the rest
                sharded_entries = save_sharded(storage, target, targets, gather=False)
                objects = targets.remaining(objects)
            weights = [unwrap_model(m).state_dict() for m in objects.models]
            models = list(objects.models)
            for hook in list(self._save_hooks.values()):
                hook(models, weights, target)
            with sync_batch():  # fsync each file while the next one is written
                written = write_contents(
                    storage,
                    target,
                    objects,
                    weights,
                    rank=self.state.process_index,
                    is_main=main,
                    max_shard_size=max_shard_size,
                )
        except Exception as exc:
            error = exc
        entries = [FileEntry(name, w.size, w.checksum) for name, w in written.items()]
        entries += sharded_entries
        gathered = ops.gather_object([(entries, None if error is None else repr(error))])
        if error is not None:
            raise CheckpointError(
                f"Saving {target} failed on process {self.state.process_index}: "
                f"{type(error).__name__}: {error}. It was not committed; earlier checkpoints "
                "are untouched."
            ) from error
        for rank, (_, failure) in enumerate(gathered):
            if failure is not None:
                raise CheckpointError(
                    f"Saving {target} failed on process {rank} ({failure}); it was not "
                    "committed and earlier checkpoints are untouched."
                )
        error = None
        if main:
            try:
                files = {e.path: e for part, _ in gathered for e in part}
                self._commit(storage, target, files, iteration, step, metrics, metadata)
            except Exception as exc:
                error = exc
        _agree(error, f"Committing {target}")

    def _hold_run_lock(self) -> None:
        """Take the project's save lock (see :mod:`~accelkit.checkpointing.lock`): a save of
        another live process into the same project_dir is refused."""
        project = self.config.project_dir
        assert project is not None  # automatic naming has a project_dir
        if self._run_lock is None or self._run_lock.root != project:
            self._run_lock = RunLock(self.storage(project), project)
        self._run_lock.acquire()

    def _release_run_lock(self) -> None:
        if self._run_lock is not None:
            self._run_lock.release()

    def _discard(self, storage: Storage, target: str) -> None:
        try:
            if read_manifest(storage, target) is None:
                storage.rmtree(target)
        except Exception as exc:
            logger.warning(
                "Could not remove the uncommitted folder %s (%s); it is ignored by loading and "
                "retention, and `accelkit ckpt prune` removes it.",
                target,
                exc,
            )

    def _prepare_folder(self, storage: Storage, target: str, automatic: bool) -> None:
        if automatic and storage.exists(target):
            raise CheckpointError(
                f"{target} already exists: accelkit never overwrites an automatic checkpoint. "
                "Call load_state() first (it sets ProjectConfiguration.iteration past the "
                "existing ones) or set iteration yourself; if another run saves into this "
                "project_dir, give each run its own."
            )
        manifest_url = join(target, MANIFEST_NAME)
        if storage.exists(manifest_url):
            storage.remove(manifest_url)  # un-commit before changing any file
            storage.fsync_dir(target)
        storage.makedirs(target)
        # First into the folder: what proves to `ckpt prune` that accelkit started this save
        # (a folder without a manifest and without the marker is never deleted).
        storage.write_bytes(join(target, SAVE_MARKER_NAME), _save_marker())

    def _commit(
        self,
        storage: Storage,
        target: str,
        files: dict[str, FileEntry],
        iteration: int,
        step: int,
        metrics: dict[str, float],
        metadata: Mapping[str, Any] | None,
    ) -> None:
        for rel in storage.walk_files(target):
            if rel in files or rel == MANIFEST_NAME:
                continue
            base = rel.rsplit("/", 1)[-1]
            if is_state_file(base) or base.startswith(f".{MANIFEST_NAME}.tmp"):
                storage.remove(join(target, rel))  # left by an earlier save into this folder
            else:  # written by a save pre-hook: part of the checkpoint
                size, checksum = file_checksum(storage, join(target, rel), DEFAULT_ALGORITHM)
                files[rel] = FileEntry(rel, size, checksum)
        import accelkit

        manifest = Manifest(
            iteration=iteration,
            step=int(step),
            world_size=self.state.num_processes,
            files=sorted(files.values(), key=lambda e: e.path),
            created=time.time(),
            metadata=dict(metadata or {}),
            metrics=metrics,
            accelkit_version=accelkit.__version__,
            torch_version=torch.__version__,
        )
        # Data files are already fsync-ed; the manifest's rename is fsync-ed with its folder
        # (journaling filesystems commit the earlier entries of the folder with it), then the
        # checkpoint folder's own entry in its parent.
        write_manifest(storage, target, manifest)
        parent = target.rstrip("/").rpartition("/")[0]
        if parent:
            storage.fsync_dir(parent)

    def _apply_retention(self, storage: Storage, target: str) -> None:
        policy = self.config.retention_policy()
        if policy.is_unlimited:
            return
        root = self.checkpoints_root()
        try:
            committed = committed_automatic(list_checkpoints(storage, root))
            doomed = select_for_deletion(committed, policy)
            for info in doomed:
                if info.path.rstrip("/") == target.rstrip("/"):
                    continue  # never the checkpoint just committed
                storage.remove(join(info.path, MANIFEST_NAME))  # un-commit first
                storage.rmtree(info.path)
        except Exception as exc:  # the new checkpoint is committed; report and go on
            logger.warning(
                "Retention under %s failed after committing %s: %s. Old checkpoints may remain;"
                " remove them with `accelkit ckpt prune`.",
                root,
                target,
                exc,
            )

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
            self.config.iteration = max(self.config.iteration, next_iteration(infos))
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
        if input_dir is not None:
            return self._load_from(os.fspath(input_dir), objects, verify)
        candidates = self._committed_newest_first()
        skipped: list[str] = []
        for info in candidates:
            try:
                return self._load_from(info.path, objects, verify)
            except CorruptCheckpointError as exc:
                skipped.append(f"{info.name}: {exc}")
                _warn_damaged(info.path, str(exc))
        raise CorruptCheckpointError(
            f"Every committed checkpoint under {self.checkpoints_root()} is damaged; nothing "
            f"was restored: {' | '.join(skipped)}"
        )

    def _load_from(self, path: str, objects: TrainingObjects, verify: bool | None) -> LoadResult:
        storage = confine(self.storage(path), path)
        info = check_loadable(storage, path)
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
        self.config.iteration = self._next_iteration(info)
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
