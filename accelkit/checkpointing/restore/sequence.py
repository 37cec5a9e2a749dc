"""The load sequence: the one path every ``load_state`` runs, whoever wrote the folder.

::

    resolve -> confine -> check (agreed) -> read -> agree -> apply -> counter -> meet

1. **resolve**: the folder the caller named, or, with none, the committed ``checkpoint_<n>``
   folders under the project's ``checkpoints`` folder, newest first (Accelerate's own
   ``checkpoint_<n>`` folders count too). With none committed, the run's counter moves past
   every ``checkpoint_<n>`` there (a run killed inside its first save left some: the next
   automatic save must not collide with them) and a
   :class:`~accelkit.checkpointing.errors.CheckpointError` says what was found. A newer
   automatic checkpoint that is damaged is named in a warning and left in place.
2. **confine**: the folder's storage, confined
   (:func:`~accelkit.checkpointing.storage.confined.confine`): no link inside it is followed.
3. **check**: every process judges its folder as ``accelkit ckpt verify`` would without reading
   checksums (:func:`~accelkit.checkpointing.restore.loading.check_loadable`) and refuses a
   per-process checkpoint another process wrote
   (:func:`~accelkit.checkpointing.restore.loading.check_owner`); the processes agree, since they
   may load different folders. The folder's state picks its reader (``committed``: accelkit's own,
   :mod:`~accelkit.checkpointing.restore.native`; ``accelerate``: the reader the caller plugs in,
   :class:`~accelkit.checkpointing.interop.accelerate_format.AccelerateReader`), which refuses what
   it cannot restore without reading the files (:meth:`FolderReader.check`).
4. **read**: the load pre-hooks run (``hook(models, path)``; removing a model from the list skips
   it), then the reader reads and checks every file this process needs, changing nothing. Its
   failure is kept for the next phase.
5. **agree**: every process learns whether any process failed to read
   (:func:`~accelkit.checkpointing.restore.loading.agree_on_load`): all raise, or none does.
6. **apply**: the reader restores the live objects from what it read.
7. **counter**: the run's counter (:class:`RunCounter`, ``ProjectConfiguration.iteration``) moves
   past the loaded checkpoint and past every ``checkpoint_<n>`` under the project, so the next
   automatic save never collides.
8. **meet**: every process waits for the others, so none starts the next save (whose new
   folder would push one process's numbering past the others') before all of them listed the
   folder.

A failure in phases 1-5 leaves every live object as it was and nothing on disk is ever
written. The error raised carries a note (PEP 678's ``__notes__``, printed with its
traceback) naming the phase and what state the run is in; :attr:`LoadSequence.phase` names
it too. With no folder named, a :class:`~accelkit.checkpointing.errors.CorruptCheckpointError`
of one candidate is logged (the folder is left in place) and the next older candidate goes
through phases 2-8.

Readers plug in from above: this room never imports them (the Accelerate reader lives in
:mod:`~accelkit.checkpointing.interop`, a higher room); the caller hands them in by folder
state.

Public API: :class:`LoadSequence`, :class:`LoadResult`, :class:`LoadSource`,
:class:`FolderReader`, :data:`OpenReader`, :class:`LoadProcess`, :class:`RunCounter`, the phase
names :data:`PHASES`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from accelkit._text import clip
from accelkit.checkpointing.catalog.listing import (
    CORRUPT,
    CheckpointInfo,
    list_checkpoints,
    loadable_automatic,
    next_iteration,
)
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.objects.contents import TrainingObjects
from accelkit.checkpointing.objects.fingerprint import Fingerprint
from accelkit.checkpointing.restore.loading import agree_on_load, check_loadable, check_owner
from accelkit.checkpointing.storage import Storage
from accelkit.checkpointing.storage.confined import confine

__all__ = [
    "PHASES",
    "FolderReader",
    "LoadProcess",
    "LoadResult",
    "LoadSequence",
    "LoadSource",
    "OpenReader",
    "RunCounter",
]

logger = logging.getLogger(__name__)

RESOLVE, CONFINE, CHECK, READ, AGREE, APPLY, COUNTER, MEET = (
    "resolve",
    "confine",
    "check",
    "read",
    "agree",
    "apply",
    "counter",
    "meet",
)
PHASES = (RESOLVE, CONFINE, CHECK, READ, AGREE, APPLY, COUNTER, MEET)
"""The phases of one load, in order (see the module docstring)."""

_UNCHANGED = "nothing was restored; the live objects are as they were"
_STATE = {
    RESOLVE: _UNCHANGED,
    CONFINE: _UNCHANGED,
    CHECK: _UNCHANGED,
    READ: _UNCHANGED,
    AGREE: _UNCHANGED,
    APPLY: "the live objects may be partly restored: load a checkpoint again before training",
    COUNTER: "the live objects were restored; ProjectConfiguration.iteration was not moved",
    MEET: "the live objects and the run's counter were restored on this process",
}


class LoadProcess(Protocol):
    """What the sequence needs to know about this process
    (``accelkit.runtime.state.PartialState`` has it)."""

    @property
    def process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    def wait_for_everyone(self) -> None: ...


class RunCounter(Protocol):
    """The run's counter: the number of the next automatic checkpoint
    (``accelkit.checkpointing.manager.IterationCounter``)."""

    @property
    def value(self) -> int:
        """The number the next automatic save uses."""
        ...

    def set(self, value: int) -> None:
        """Make ``value`` the next number (the one place that writes it)."""
        ...


@dataclass(frozen=True)
class LoadResult:
    """What a load restored.

    Attributes:
        path: the checkpoint's folder or URL.
        manifest: its manifest (an Accelerate folder gets one made up by its reader).
        fingerprint: this process's resume fingerprint as the checkpoint recorded it (see
            :mod:`accelkit.checkpointing.objects.fingerprint`); ``None`` when it has none.
        tier: where it came from (:data:`~accelkit.checkpointing.formats.manifest.RESUME_TIERS`):
            ``"path"`` for a folder the caller named; a ``load_state()`` without one says
            which tier resolved it (``"memory"``, ``"local"`` or ``"remote"``).
    """

    path: str
    manifest: Manifest
    fingerprint: Fingerprint | None = None
    tier: str = "path"


@dataclass(frozen=True)
class LoadSource:
    """One checked folder, as a reader gets it.

    Attributes:
        path: the folder (path or URL).
        storage: a confined view of it (phase 2).
        info: what the check phase found (``state`` ``committed`` or ``accelerate``;
            ``manifest`` for a committed one).
        rank: this process's index.
        world_size: this run's number of processes.
        is_main: this is the main process (it logs what is said once).
        verify: check the files' checksums while reading them.
    """

    path: str
    storage: Storage
    info: CheckpointInfo
    rank: int
    world_size: int
    is_main: bool
    verify: bool


class FolderReader(Protocol):
    """One kind of checkpoint folder, read for one load: phases 3 (its part), 4 and 6.

    Made by an :data:`OpenReader` from a :class:`LoadSource`; it may keep what it read between
    :meth:`read` and :meth:`apply`.
    """

    def check(self, objects: TrainingObjects) -> None:
        """Phase 3, this process: refuse what cannot be restored into ``objects``, before any
        hook runs or any file is read.

        Raises:
            CheckpointError: naming what does not fit and the fix.
        """
        ...

    def read(self, objects: TrainingObjects) -> None:
        """Phase 4, this process: read and check every file needed to restore ``objects``
        (after the load pre-hooks); change nothing.

        Raises:
            CheckpointError: a file refused (``CorruptCheckpointError``) or that does not fit
                (``CheckpointMismatchError``); agreed by the sequence.
        """
        ...

    def apply(self) -> Manifest:
        """Phase 6, every process: restore the live objects from what :meth:`read` read.

        Returns:
            The checkpoint's manifest (or one describing it).
        """
        ...

    @property
    def fingerprint(self) -> Fingerprint | None:
        """This process's resume fingerprint, read in phase 4 (``None``: the folder has
        none)."""
        ...


OpenReader = Callable[[LoadSource], FolderReader]
"""Makes the reader of one folder (a reader class is one)."""


def _warn_damaged(path: str, why: str | None) -> None:
    logger.warning(
        "Not resuming from %s: it is damaged (%s). Resuming from the newest older checkpoint "
        "that loads; the damaged one is left in place (`accelkit ckpt verify` shows it).",
        clip(path, 1000),
        clip(why or "", 2000),  # the reason quotes the checkpoint's own names and may be huge
    )


class LoadSequence:
    """One ``load_state``, phase by phase (see the module docstring); must run on every process.

    Args:
        process: this process.
        storage_for: the storage of a path or URL (with the run's storage options).
        readers: how to read a folder, by the state the check phase finds (``committed``,
            ``accelerate``); a state without a reader is refused.
        counter: the run's counter, moved in phase 7 (and in phase 1 when nothing is
            committed).
        root: the project's ``checkpoints`` folder; ``None`` without a ``project_dir`` (a
            folder must then be named).
        hooks: the load pre-hooks, ``hook(models, path)``, run at the start of phase 4.
        verify: check the files' checksums while reading them.

    Attributes:
        phase: the phase running, or the last one that ran (the one that failed, after a
            failure).
        completed: the phases the current (or last) folder went through, in order.
    """

    def __init__(
        self,
        process: LoadProcess,
        storage_for: Callable[[str], Storage],
        readers: Mapping[str, OpenReader],
        counter: RunCounter,
        *,
        root: str | None,
        hooks: Sequence[Callable[..., None]] = (),
        verify: bool = True,
    ) -> None:
        self.process = process
        self.storage_for = storage_for
        self.readers = dict(readers)
        self.counter = counter
        self.root = root
        self.hooks = list(hooks)
        self.verify = verify
        self.phase = RESOLVE
        self.completed: list[str] = []

    def run(self, input_dir: str | None, objects: TrainingObjects) -> LoadResult:
        """Restore ``objects`` from ``input_dir``, or from the newest committed checkpoint
        under :attr:`root` that loads.

        Raises:
            CheckpointError: nothing committed there, or the folder is not a committed
                checkpoint (the message says what it is and what to pass instead).
            CorruptCheckpointError / CheckpointMismatchError: a file refused, or one that does
                not fit ``objects``; with ``input_dir=None``, only once every committed
                checkpoint was tried. Each carries a note naming the phase.
        """
        self.phase, self.completed = RESOLVE, []
        if input_dir is not None:
            return self.load_from(input_dir, objects)
        try:
            candidates = self.resolve()
        except Exception as exc:
            self._note(exc)
            raise
        skipped: list[str] = []
        for info in candidates:
            try:
                return self.load_from(info.path, objects)
            except CorruptCheckpointError as exc:
                skipped.append(f"{info.name}: {exc}")
                _warn_damaged(info.path, str(exc))
        raise CorruptCheckpointError(
            f"Every committed checkpoint under {self.root} is damaged; nothing was restored: "
            f"{' | '.join(skipped)}"
        )

    # ------------------------------------------------------------------ phases

    def resolve(self) -> list[CheckpointInfo]:
        """Phase 1 without a named folder: the committed checkpoints under :attr:`root`,
        newest first.

        Raises:
            CheckpointError: none is committed (the counter moved past every folder there).
        """
        assert self.root is not None, "load_state() without a folder needs a project_dir"
        root = self.root
        infos = list_checkpoints(self.storage_for(root), root)
        committed = loadable_automatic(infos)
        if not committed:
            self.counter.set(max(self.counter.value, next_iteration(infos)))
            others = ", ".join(f"{i.name} ({i.state})" for i in infos) or "nothing"
            raise CheckpointPathError(
                f"No committed checkpoint under {root} (found: {others}). Save one with "
                "save_state() first, or pass the checkpoint's path to load_state()."
            )
        newest = committed[-1].iteration or 0
        for info in infos:
            if info.state == CORRUPT and info.is_automatic and (info.iteration or 0) > newest:
                _warn_damaged(info.path, info.error)
        return committed[::-1]

    def load_from(self, path: str, objects: TrainingObjects) -> LoadResult:
        """Phases 2-8 for the folder ``path``.

        Raises:
            CheckpointError: as :meth:`run`; the note on it names the phase.
        """
        self.phase, self.completed = RESOLVE, []
        try:
            return self._load_from(path, objects)
        except Exception as exc:
            self._note(exc)
            raise

    def _load_from(self, path: str, objects: TrainingObjects) -> LoadResult:
        self._begin(CONFINE)
        storage = confine(self.storage_for(path), path)
        self._begin(CHECK)
        info = self._check(storage, path)
        source = LoadSource(
            path=path,
            storage=storage,
            info=info,
            rank=self.process.process_index,
            world_size=self.process.num_processes,
            is_main=self.process.is_main_process,
            verify=self.verify,
        )
        reader = self._reader(source)
        reader.check(objects)
        self._begin(READ)
        error: CheckpointError | None = None
        try:
            reader.read(self._hooked(objects, path))
        except CheckpointError as exc:
            error = exc
        self._begin(AGREE)
        try:
            agree_on_load(error, path)
        except CheckpointError:
            if error is not None:  # this process's own read failed: that is where it stopped
                self.phase = READ
            raise
        self._begin(APPLY)
        manifest = reader.apply()
        self._begin(COUNTER)
        self.counter.set(self._next_iteration(info))
        self._begin(MEET)
        self.process.wait_for_everyone()
        self.completed.append(MEET)
        return LoadResult(path, manifest, reader.fingerprint)

    def _check(self, storage: Storage, path: str) -> CheckpointInfo:
        """Phase 3's agreed part: the folder is loadable, and by this process."""
        info: CheckpointInfo | None = None
        error: CheckpointError | None = None
        try:
            info = check_loadable(storage, path)
            if info.manifest is not None:
                check_owner(info.manifest, path, self.process.process_index)
        except CheckpointError as exc:
            error = exc
        agree_on_load(error, path)  # the processes may load different folders
        assert info is not None
        return info

    def _reader(self, source: LoadSource) -> FolderReader:
        open_reader = self.readers.get(source.info.state)
        if open_reader is None:
            raise CheckpointError(
                f"{source.path} is a checkpoint in the {source.info.state!r} format, which this "
                f"load cannot read (it reads {', '.join(sorted(self.readers))}); nothing was "
                "restored."
            )
        return open_reader(source)

    def _hooked(self, objects: TrainingObjects, path: str) -> TrainingObjects:
        """The objects after the load pre-hooks, which may drop models from the list."""
        models = list(objects.models)
        for hook in self.hooks:
            hook(models, path)
        return dataclasses.replace(objects, models=models)

    def _next_iteration(self, info: CheckpointInfo) -> int:
        candidates = [0 if info.iteration is None else info.iteration + 1]
        if self.root is not None:
            candidates.append(
                next_iteration(list_checkpoints(self.storage_for(self.root), self.root))
            )
        return max(candidates)

    # ------------------------------------------------------------------ bookkeeping

    def _begin(self, phase: str) -> None:
        """The phase before ``phase`` finished; ``phase`` starts."""
        self.completed.append(self.phase)
        self.phase = phase

    def _note(self, exc: Exception) -> None:
        """Note on ``exc`` the phase it stopped the load in and the state that leaves."""
        note = f"The load stopped in its {self.phase} phase: {_STATE[self.phase]}."
        if sys.version_info >= (3, 11):
            exc.add_note(note)
        else:  # PEP 678's attribute: the exceptiongroup backport prints it, as 3.11 does
            setattr(exc, "__notes__", [*getattr(exc, "__notes__", []), note])  # noqa: B010
