"""The commit protocol: the one sequence every save runs, synchronous or in the background.

::

    prepare (main, under the run lock) -> agree -> capture -> agree -> write -> exchange
        -> commit (main) -> agree -> retention (main) -> release the lock -> done

1. **prepare**: the main process takes the project's save lock for an automatic checkpoint
   (:mod:`~accelkit.checkpointing.commit.lock`) and checks its ``checkpoint_<n>`` name (below);
   every process refuses a folder that is itself a symbolic link (loading refuses one, so such a
   save could never be loaded). All processes agree on the outcome, adopt the main process's number
   and exchange their folders, resolved (:mod:`~accelkit.checkpointing.commit.per_process`, which
   lists the refused cases: aliasing or nested folders among them); if each process gave a folder of
   its own, every process writes and commits a complete checkpoint into its own folder. Nothing is
   written before this agreement. Then the main process (and, per process, each one) prepares its
   folder: an automatic one is created exclusively
   (:func:`~accelkit.checkpointing.commit.lock.claim_folder`), an explicit one holding a manifest is
   un-committed, and the save marker ``.accelkit-save.json`` goes first into it (what proves to
   ``ckpt prune`` that accelkit started this save); a failure there is agreed with the capture.

   An automatic name that is already taken: if an ``accelkit ckpt import`` wrote that folder
   (its save marker says so; the import took the same lock, so it is finished), the save
   moves on, still under the lock, to the next number no folder uses, and succeeds. Anything
   else there (another run's checkpoint, a folder of the user's, a run started without
   ``load_state()`` in an old project) is refused once, as Accelerate refuses it, and the
   run's counter moves past every existing ``checkpoint_<n>`` so the next save succeeds:
   skipping silently would let two runs rotate away each other's checkpoints, and refusing
   forever would stop training for good (:attr:`SaveSequence.next_iteration`).
2. **capture**: every process takes its share of the state (a
   :class:`~accelkit.checkpointing.commit.payload.Payload`: the live objects, or a frozen host
   copy). The main process clears the ``sharded/`` folder of an earlier save if this one writes
   sharded state. All processes agree that every one of them captured, so a failed capture never
   leaves the others waiting inside a collective write.
3. **write**: every process writes its files (each made durable), sharded (FSDP) state first,
   then they exchange the list of what they wrote.
4. **commit**: if every process succeeded, the main process removes files of an earlier save
   that this one did not write and writes ``accelkit.json`` last (atomically); all agree.
5. **retention**: only after the commit, only on the main process, only for an automatic
   checkpoint (:mod:`~accelkit.checkpointing.commit.deletion`); its failures are logged, never
   raised.
6. **release** the save lock, and all processes meet once more (**done**), so that no process
   returns (or completes its handle) before the commit and the retention.

On a failure at any phase the checkpoint is not committed; the main process removes an
automatically named folder (whose name is spent) and gives the lock back; every process raises
a :class:`~accelkit.checkpointing.errors.CheckpointError` naming the process that failed.

The sequence is parameterised by a :class:`Coordinator` (how processes exchange messages:
:class:`DefaultCoordinator` on the default process group for a synchronous save,
:class:`GroupCoordinator` on the writer's own gloo group for an asynchronous one) and by the
payload (what is written). :mod:`~accelkit.checkpointing.commit.async_save` is a driver around
it: it runs phases 1-2 in the caller's thread and the rest in a writer thread.

Public API: :class:`Coordinator`, :class:`DefaultCoordinator`, :class:`GroupCoordinator`,
:class:`SaveRequest`, :class:`SaveSequence`, the phase names :data:`PHASES`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from accelkit._version import __version__
from accelkit.checkpointing.commit.deletion import remove_folder
from accelkit.checkpointing.commit.lock import RunLock, claim_folder
from accelkit.checkpointing.commit.payload import Payload
from accelkit.checkpointing.commit.per_process import folders_per_process, resolve_folder
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import (
    MANIFEST_NAME,
    SAVE_MARKER_NAME,
    checkpoint_name,
    is_state_file,
    parse_checkpoint_name,
)
from accelkit.checkpointing.formats.manifest import (
    FileEntry,
    Manifest,
    file_checksum,
    write_manifest,
)
from accelkit.checkpointing.sharded import clear_sharded
from accelkit.checkpointing.storage import Storage, join, sync_batch
from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM
from accelkit.runtime import ops

__all__ = [
    "save_marker",
    "PHASES",
    "Coordinator",
    "DefaultCoordinator",
    "GroupCoordinator",
    "ProcessIdentity",
    "SaveRequest",
    "SaveSequence",
]

logger = logging.getLogger(__name__)

PREPARE, CAPTURE, WRITE, COMMIT, DONE = "prepare", "capture", "write", "commit", "done"
PHASES = (PREPARE, CAPTURE, WRITE, COMMIT, DONE)
"""The exchanges of one save, in order; a :class:`Coordinator` sees each once per save."""

_DOING = {
    PREPARE: "while preparing the folder",
    CAPTURE: "while capturing its state",
    WRITE: "while writing its files",
    COMMIT: "while committing",
    DONE: "after the commit",
}


class Coordinator(Protocol):
    """How the processes of one save exchange messages.

    ``exchange`` is an all-gather of a small picklable item: every process calls it with the
    same ``phase``, in the same order, and gets every process's item by rank. It raises if the
    processes cannot meet (one of them died).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def group(self) -> Any:
        """The process group collective writes (DCP) run on; ``None`` for the default one."""
        ...

    def exchange(self, phase: str, item: Any) -> list[Any]: ...


class ProcessIdentity(Protocol):
    """What :class:`DefaultCoordinator` needs (``accelkit.runtime.state.PartialState`` has it)."""

    @property
    def process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...


class DefaultCoordinator:
    """Exchanges on the default process group (a synchronous save, in the training thread)."""

    def __init__(self, state: ProcessIdentity) -> None:
        self.rank = state.process_index
        self.world_size = state.num_processes
        self.group: Any = None

    def exchange(self, phase: str, item: Any) -> list[Any]:
        return ops.gather_object([item])


class GroupCoordinator:
    """Exchanges on a process group of its own (a writer thread must never run collectives on
    the group the training loop uses); ``group=None`` means a single process."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def exchange(self, phase: str, item: Any) -> list[Any]:
        if self.group is None:
            return [item]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, item, group=self.group)
        return out


@dataclass(frozen=True)
class SaveRequest:
    """What one save commits, fixed at the call.

    Attributes:
        target: the checkpoint folder (path or URL).
        automatic: a ``checkpoint_<n>`` under the project (locked, retained, never overwritten).
        iteration: the number recorded in the manifest.
        step: optimizer steps taken.
        metrics: numbers for ``keep_best`` retention.
        metadata: JSON values stored in the manifest.
        max_shard_size: for model files.
        experiment: the tracker runs the checkpoint belongs to (the manifest's
            ``experiment``).
        sharded: whether sharded (FSDP) state is written (it needs one folder shared by all).
        total_limit: how many checkpoints retention keeps (for a full disk's message).
        reason: why the checkpoint is made (the manifest's ``reason``).
    """

    target: str
    automatic: bool
    iteration: int
    step: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    max_shard_size: int | str = "10GB"
    experiment: Mapping[str, Any] = field(default_factory=dict)
    sharded: bool = False
    total_limit: int | None = None
    reason: str = "user"


def save_marker(**origin: str) -> bytes:
    """The content of a save marker (``SAVE_MARKER_NAME``): who started writing the folder,
    when, and ``origin`` (``imported_from=``/``replicated_from=`` the source it copies)."""
    doc = {"format": "accelkit-save", "started": time.time(), "host": socket.gethostname()}
    return json.dumps({**doc, "pid": os.getpid(), **origin}).encode()


def _detail(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _out_of_space(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a full disk or quota."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _space_hint(total_limit: int | None) -> str:
    """What a full disk means for a save: the new checkpoint is written, and committed, before
    retention removes the oldest, so the storage needs room for one checkpoint more than are
    kept."""
    if total_limit is None:
        room = "one more checkpoint beside all those kept (total_limit is not set: none is removed)"
    else:
        room = (
            f"total_limit + 1 = {total_limit + 1} checkpoints (the new one is written and "
            "committed before retention removes the oldest)"
        )
    return (
        f" The storage is full: a save needs room for {room}. Free space, lower total_limit, "
        "or save elsewhere."
    )


_MARKER_READ_LIMIT = 1 << 16  # a save marker is ~150 bytes; a bigger one is not ours


def _parent(target: str) -> str:
    return target.rstrip("/").rpartition("/")[0]


def _next_free(storage: Storage, root: str) -> int:
    """1 + the highest ``checkpoint_<n>`` number under ``root`` (any state); 0 if none."""
    numbers = [parse_checkpoint_name(e.name) for e in storage.listdir(root)]
    present = [n for n in numbers if n is not None]
    return max(present) + 1 if present else 0


def _imported(storage: Storage, folder: str) -> bool:
    """Whether ``folder`` was written by ``accelkit ckpt import`` (its save marker names the
    source). The folder is untrusted: a link, a huge or malformed marker is not an import."""
    if storage.is_symlink(folder) or storage.links_out(folder, SAVE_MARKER_NAME):
        return False
    try:
        raw = storage.read_bytes(join(folder, SAVE_MARKER_NAME), 0, _MARKER_READ_LIMIT)
        doc = load_json(raw, join(folder, SAVE_MARKER_NAME), max_depth=2)
    except (OSError, CorruptCheckpointError):  # unreadable, cut or not JSON: not an import's
        return False
    return isinstance(doc, dict) and isinstance(doc.get("imported_from"), str)


class SaveSequence:
    """One save, phase by phase (see the module docstring).

    Args:
        coordinator: how the processes exchange messages.
        storage: the storage of ``request.target``.
        request: what is saved where.
        lock: the project's save lock, taken by the main process in :meth:`prepare` and given
            back after the retention (``None``: no lock, e.g. an explicit folder).
        retention: run by the main process after the commit of an automatic checkpoint, with
            the committed folder's path; it must log its own failures.
        label: how messages name this save (``"Saving"``, ``"Asynchronous save of"``).
        on_commit: run by the main process after the commit and the retention, with this
            sequence (its :attr:`manifest`, :attr:`captured_at`); failures are logged.

    Attributes:
        manifest: the committed manifest (main process, after the commit).
        captured_at: ``time.perf_counter()`` when this process's capture returned.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        storage: Storage,
        request: SaveRequest,
        lock: RunLock | None = None,
        retention: Callable[[str], None] | None = None,
        label: str = "Saving",
        on_commit: Callable[[SaveSequence], None] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.storage = storage
        self.request = request
        self.lock = lock
        self.retention = retention
        self.label = label
        self.on_commit = on_commit
        self.manifest: Manifest | None = None
        self.captured_at = 0.0
        self.is_main = coordinator.rank == 0
        self._payload: Payload | None = None
        self._capture_error: BaseException | None = None
        self._committed = False  # this process wrote the manifest
        # Each process saves a checkpoint of its own into its own folder (decided in prepare).
        self.per_process = False
        # The run's next automatic number after prepare() (see the module docstring).
        self.next_iteration = request.iteration
        self._claimed = False  # this process created the automatic folder
        self._folder_error: BaseException | None = None

    @property
    def target(self) -> str:
        return self.request.target

    # ------------------------------------------------------------------ errors

    def _failed(self, rank: int, phase: str, detail: str) -> CheckpointError:
        return CheckpointError(
            f"{self.label} {self.target} failed on process {rank} {_DOING[phase]}: {detail}. "
            "It was not committed; earlier checkpoints are untouched. Fix the cause and save "
            "again."
        )

    def _exchange(self, phase: str, item: Any) -> list[Any]:
        try:
            return self.coordinator.exchange(phase, item)
        except Exception as exc:
            if phase == DONE or self._committed:
                state = "It was committed"
            elif phase == COMMIT:
                state = "Process 0 may have committed it; `accelkit ckpt ls` shows its state"
            else:
                state = "It was not committed; earlier checkpoints are untouched"
            raise CheckpointError(
                f"{self.label} {self.target}: process {self.coordinator.rank} lost contact "
                f"with the other processes {_DOING[phase]} ({_detail(exc)}). {state}."
            ) from exc

    def _agree(self, phase: str, error: BaseException | None, item: Any = None) -> list[Any]:
        """Exchange ``(failure, item)``; raise on every process if any process failed.

        A :class:`CheckpointError` of this process from the prepare phase is raised as it is
        (it already names the folder and the fix); any other failure of this process is
        wrapped, and the others name the first failing process.
        """
        detail = None if error is None else self._describe(error)
        return self._check(phase, error, self._exchange(phase, (detail, item)))

    def _describe(self, error: BaseException) -> str:
        """``Type: message``, with what a full disk means for a save where it is one."""
        hint = _space_hint(self.request.total_limit) if _out_of_space(error) else ""
        return _detail(error) + hint

    def _check(self, phase: str, error: BaseException | None, gathered: list[Any]) -> list[Any]:
        """Raise the failure of this process or of another one in ``gathered`` (see
        :meth:`_agree`); return the items."""
        if error is not None:
            if phase == PREPARE and isinstance(error, CheckpointError):
                raise error
            raise self._failed(self.coordinator.rank, phase, self._describe(error)) from error
        for rank, (failure, _) in enumerate(gathered):
            if failure is not None:
                raise self._failed(rank, phase, failure)
        return [entry for _, entry in gathered]

    # ------------------------------------------------------------------ phases

    def prepare(self) -> None:
        """Phase 1, on every process: the main process takes the lock and checks the automatic
        name; all agree on it and on the folders; then the folders are prepared.

        Raises:
            CheckpointError: the folder cannot be used (it exists, it is a symbolic link, the
                lock is held by another run, the folders of the processes clash, the storage
                failed); nothing was written and the lock is not held then.
        """
        error: BaseException | None = None
        try:
            if self.is_main and self.lock is not None:
                self.lock.acquire()
            if self.request.automatic:
                if self.is_main:  # a link there exists too: refused (once) as taken
                    self._choose_number()
            else:
                self._refuse_link()
        except Exception as exc:
            error = exc
        item = (self.request.iteration, self.next_iteration, resolve_folder(self.target))
        try:
            gathered = self._exchange(PREPARE, (None if error is None else _detail(error), item))
            if self.request.automatic:
                # The main process chose the number under the lock: every process adopts it.
                main_iteration, self.next_iteration, _ = gathered[0][1]
                self._adopt(main_iteration)
            self._check(PREPARE, error, gathered)
        except BaseException:
            self._release()
            raise
        try:  # the same decision on every process, from the same folders
            folders = [entry[2] for _, entry in gathered]
            if self.request.automatic and _same_root(folders):
                folders = [folders[0]] * len(folders)  # each adopted the main process's number
            self.per_process = folders_per_process(
                folders, self.request.automatic, self.request.sharded
            )
        except BaseException:
            self._abandon()
            raise
        self.next_iteration = self.request.iteration + 1
        if self.is_main or self.per_process:
            try:
                self._prepare_folder()
            except Exception as exc:  # agreed with the capture: every process raises
                self._folder_error = exc

    def _adopt(self, iteration: int) -> None:
        if iteration != self.request.iteration:
            target = join(_parent(self.target), checkpoint_name(iteration))
            self.request = replace(self.request, iteration=iteration, target=target)

    def _choose_number(self) -> None:
        """Under the lock: move past folders imports took; refuse any other taken name, with
        the counter past every existing ``checkpoint_<n>``."""
        storage, root = self.storage, _parent(self.target)
        while storage.exists(self.target):
            if not _imported(storage, self.target):
                self.next_iteration = max(self.request.iteration, _next_free(storage, root))
                raise CheckpointPathError(
                    f"{self.target} already exists: accelkit never overwrites an automatic "
                    "checkpoint, and this save was not written. The next save uses "
                    f"{checkpoint_name(self.next_iteration)}. Call load_state() first (it sets "
                    "ProjectConfiguration.iteration past the existing ones) or set iteration "
                    "yourself; if another run saves into this project_dir, give each run its own."
                )
            number = max(self.request.iteration + 1, _next_free(storage, root))
            logger.info(
                "%s was written by `accelkit ckpt import`; this save uses %s instead.",
                self.target,
                checkpoint_name(number),
            )
            self._adopt(number)

    def _refuse_link(self) -> None:
        folder = self.target.rstrip("/") or self.target
        if self.storage.is_symlink(folder):
            raise CheckpointPathError(
                f"{self.target} is a symbolic link: loading never follows a link to a "
                "checkpoint folder (it could point anywhere), so a checkpoint saved through it "
                "could never be loaded. Save into the real folder "
                f"({os.path.realpath(folder)}) or another one; nothing was written."
            )

    def _prepare_folder(self) -> None:
        storage, target = self.storage, self.target
        if self.request.automatic:
            try:
                claim_folder(storage, target, SAVE_MARKER_NAME, save_marker())
            except FileExistsError as exc:
                raise CheckpointError(
                    f"{target} was created by another process while this save claimed it "
                    f"({exc}); it was left as it is. If another run saves into this "
                    "project_dir, give each run its own."
                ) from None
            self._claimed = True
            return
        manifest_url = join(target, MANIFEST_NAME)
        if storage.exists(manifest_url):
            storage.remove(manifest_url)  # un-commit before changing any file
            storage.fsync_dir(target)
        storage.makedirs(target)
        # First into the folder: what proves to `ckpt prune` that accelkit started this save
        # (a folder without a manifest and without the marker is never deleted).
        storage.write_bytes(join(target, SAVE_MARKER_NAME), save_marker())

    def capture(self, build: Callable[[], Payload]) -> None:
        """Phase 2, this process's part: take its share of the state. A failure is kept and
        reported to every process by :meth:`finish`."""
        if self._folder_error is not None:  # reported by finish(); hooks must not run
            return
        try:
            self._payload = build()
        except Exception as exc:
            self._capture_error = exc
        except BaseException:  # interrupted: this process will not reach the next phase
            self._abandon()
            raise
        self.captured_at = time.perf_counter()

    def finish(self) -> None:
        """Phases 2 (agreement) to 6, on every process (in a writer thread for an asynchronous
        save): write, exchange, commit, retention, release, done.

        Raises:
            CheckpointError: any process failed; the checkpoint is not committed.
        """
        try:
            files = self._write()
            self._commit(files)
            if self.is_main and self.request.automatic and self.retention is not None:
                self.retention(self.target)  # logs its own failures
        except BaseException:
            self._abandon()
            raise
        if self.is_main and self.on_commit is not None:
            try:
                self.on_commit(self)
            except Exception:
                logger.warning("After committing %s:", self.target, exc_info=True)
        self._release()
        self._exchange(DONE, None)

    def _write(self) -> dict[str, FileEntry]:
        payload, error = self._payload, self._folder_error or self._capture_error
        if error is None and payload is not None and payload.has_sharded and self.is_main:
            try:
                clear_sharded(self.storage, self.target)  # may be of another world size
            except Exception as exc:
                error = exc
        self._agree(CAPTURE, error)
        assert payload is not None
        entries: list[FileEntry] = []
        error = None
        try:
            if payload.has_sharded:  # a collective of every process on the coordinator's group
                entries += payload.write_sharded(self.storage, self.target, self.coordinator.group)
            with sync_batch():  # fsync each file while the next one is written
                written = payload.write(self.storage, self.target, self.request.max_shard_size)
            entries += [FileEntry(name, w.size, w.checksum) for name, w in written.items()]
        except Exception as exc:
            error = exc
        self._payload = None  # host buffers may be reused once the files are written
        parts = self._agree(WRITE, error, entries)
        if self.per_process:  # the other processes' files are in their own folders
            parts = [parts[self.coordinator.rank]]
        return {e.path: e for part in parts for e in part}

    def _commit(self, files: dict[str, FileEntry]) -> None:
        error: BaseException | None = None
        if self.is_main or self.per_process:
            try:
                self._write_manifest(files)
                self._committed = True
            except Exception as exc:
                error = exc
        self._agree(COMMIT, error)

    def _write_manifest(self, files: dict[str, FileEntry]) -> None:
        storage, target = self.storage, self.target
        for rel in storage.walk_files(target):
            if rel in files or rel == MANIFEST_NAME:
                continue
            base = rel.rsplit("/", 1)[-1]
            if is_state_file(base) or base.startswith(f".{MANIFEST_NAME}.tmp"):
                storage.remove(join(target, rel))  # left by an earlier save into this folder
            else:  # written by a save pre-hook: part of the checkpoint
                size, checksum = file_checksum(storage, join(target, rel), DEFAULT_ALGORITHM)
                files[rel] = FileEntry(rel, size, checksum)
        request = self.request
        manifest = Manifest(
            iteration=request.iteration,
            step=int(request.step),
            world_size=self.coordinator.world_size,
            files=sorted(files.values(), key=lambda e: e.path),
            created=time.time(),
            metadata=dict(request.metadata),
            metrics=dict(request.metrics),
            experiment=dict(request.experiment),
            accelkit_version=__version__,
            torch_version=torch.__version__,
            process_index=self.coordinator.rank if self.per_process else None,
            reason=request.reason,
        )
        # Data files are already fsync-ed; the manifest's rename is fsync-ed with its folder
        # (journaling filesystems commit the earlier entries of the folder with it), then the
        # checkpoint folder's own entry in its parent.
        write_manifest(storage, target, manifest)
        self.manifest = manifest
        parent = target.rstrip("/").rpartition("/")[0]
        if parent:
            storage.fsync_dir(parent)

    # ------------------------------------------------------------------ clean-up

    def _abandon(self) -> None:
        """After a failure: drop the payload, remove the spent automatic folder, give the lock
        back."""
        self._payload = None
        if self.is_main and self.request.automatic:
            self._discard()
        self._release()

    def _release(self) -> None:
        if self.is_main and self.lock is not None:
            self.lock.release()

    def _discard(self) -> None:
        """Remove the uncommitted automatic folder (its name is spent, and this save created
        it under the lock), whatever a failed commit left in it, if the storage lets."""
        if self._committed or not self._claimed:
            return  # committed, or never created by this save (another's: never touched)
        try:
            remove_folder(self.storage, self.target)
        except Exception as exc:
            logger.warning(
                "Could not remove the uncommitted folder %s (%s); it is ignored by loading and "
                "retention, and `accelkit ckpt prune` removes it.",
                self.target,
                exc,
            )


def _same_root(folders: list[Any]) -> bool:
    """Whether automatic folders differ only by their ``checkpoint_<n>`` name (each process's
    own counter; the main process's number is the one used)."""
    return len({_parent(f.real) for f in folders}) == 1
