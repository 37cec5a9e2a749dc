"""The memory tier (:class:`MemoryTier`): where each process keeps its snapshots, their
rotation, and the resolve of ``load_state()`` without a folder.

Layout, in the job's shared-memory folder (:func:`accelkit.runtime.job_memory.job_memory_dir`,
which ``accelkit launch`` keeps across restarts and removes at the job's end), one folder per
project (a run that starts after another in the same job, with its own ``project_dir``, never
sees the other's snapshots, as ``load_state()`` never sees another project's checkpoints)::

    <job memory>/<project key>/rank_<r>/snapshot_<step>/    process r's state, complete
    <job memory>/<project key>/copies/rank_<src>/...        the copy this process keeps of src's

Each snapshot is a per-process checkpoint (:mod:`~accelkit.checkpointing.commit.per_process`):
written and committed by the asynchronous save with its own manifest and checksums, loadable
by the process that wrote it only. On several machines each machine's shared memory holds the
snapshots of its own processes. A process keeps its newest committed snapshot and the one being
written; older ones are removed as a new one starts, and a load of an older state (a
rollback to a checkpoint) removes every snapshot of a step after it: they belong to the
abandoned trajectory. A folder that is not what the tier wrote (a file, a link, a snapshot
whose name and manifest disagree) is not used.

The resolve (:meth:`MemoryTier.resolve`): every process lists its committed snapshots and the
peer copies it keeps (:mod:`~accelkit.checkpointing.memory.peer`); they agree on the newest step
every process can have (its own snapshot, or its holder's copy, brought back first), and that
snapshot is restored if it is newer (more optimizer steps) than the newest committed checkpoint
under ``project_dir`` as any process sees it. Else, or if it is damaged or cannot be brought
back (agreed: every process falls back together), the next older one, then the tiers below.
Restoring a snapshot leaves the run's counter where an uninterrupted run's is: past every
``checkpoint_<n>`` folder.

Public API: :class:`MemoryTier`, :func:`project_key`, :data:`SNAPSHOT_PREFIX`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Collection

from accelkit._text import clip
from accelkit.checkpointing.catalog.listing import (
    COMMITTED,
    CheckpointInfo,
    list_checkpoints,
    loadable_automatic,
    next_iteration,
)
from accelkit.checkpointing.commit.deletion import HoldBudget
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.memory.options import MemoryOptions
from accelkit.checkpointing.memory.peer import COPIES, fetch_missing, held_source
from accelkit.checkpointing.objects.contents import TrainingObjects
from accelkit.checkpointing.restore.sequence import LoadResult, LoadSequence
from accelkit.checkpointing.storage import Storage
from accelkit.runtime import ops
from accelkit.runtime.job_memory import job_memory_dir

__all__ = ["SNAPSHOT_PREFIX", "MemoryTier", "project_key"]

logger = logging.getLogger("accelkit.checkpointing.memory")

#: A snapshot's folder: ``snapshot_<optimizer steps>``.
SNAPSHOT_PREFIX = "snapshot_"


class MemoryTier:
    """The memory tier of one process (see the module docstring); inert without
    ``MemoryOptions.every_steps`` or outside a job with shared memory.

    Args:
        options: the run's :class:`~accelkit.checkpointing.memory.options.MemoryOptions`.
        rank: this process's index.
        storage_for: the storage of a path (the manager's).
        world: the number of processes.
        local: processes per machine (the peer-copy ring's stride).
    """

    def __init__(
        self,
        options: MemoryOptions,
        rank: int,
        storage_for: Callable[[str], Storage],
        world: int = 1,
        local: int = 1,
        project_dir: str | None = None,
    ) -> None:
        self.options = options
        self.rank = rank
        self.world = world
        self.local = local
        self.storage_for = storage_for
        self.project_dir = project_dir
        self._warned = False

    @property
    def root(self) -> str | None:
        """This project's folder in the job's shared memory, or ``None`` when the tier is off
        (no ``every_steps``, no ``project_dir``, or not under ``accelkit launch``)."""
        memory = job_memory_dir() if self.options.every_steps and self.project_dir else None
        if memory is None or self.project_dir is None:
            return None
        return os.path.join(memory, project_key(self.project_dir))

    @property
    def folder(self) -> str | None:
        """This process's snapshot folder, or ``None`` when the tier is off (no
        ``every_steps``, or no job memory: not under ``accelkit launch``)."""
        root = self.root
        return None if root is None else os.path.join(root, f"rank_{self.rank}")

    def usable(self) -> bool:
        """Whether this process's folder can take a snapshot: absent (made by the save), or a
        real folder (not a link, not a file)."""
        folder = self.folder
        if folder is None:
            return False
        return not os.path.lexists(folder) or (os.path.isdir(folder) and not os.path.islink(folder))

    def snapshot_path(self, steps: int) -> str:
        """Where the snapshot taken after ``steps`` optimizer steps goes."""
        folder = self.folder
        assert folder is not None, "the memory tier is off"
        return os.path.join(folder, f"{SNAPSHOT_PREFIX}{steps}")

    def held_folder(self) -> str | None:
        """Where this process keeps its peer's copies (``None`` when the tier is off)."""
        root = self.root
        if root is None or self.world == 1:
            return None
        src = held_source(self.rank, self.world, self.local)
        return os.path.join(root, COPIES, f"rank_{src}")

    def committed(self, folder: str | None = None) -> list[CheckpointInfo]:
        """This process's committed snapshots (or those in ``folder``: the peer's copies),
        oldest first; none when the tier is off or the folder cannot be read (said once)."""
        folder = self.folder if folder is None else folder
        if folder is None or not os.path.lexists(folder):
            return []
        problem = None
        if os.path.islink(folder) or not os.path.isdir(folder):
            problem = "a link or a file, not a folder the tier made"
        else:
            try:
                infos = list_checkpoints(self.storage_for(folder), folder)
            except OSError as exc:
                problem = str(exc)
        if problem is not None:
            if not self._warned:
                self._warned = True
                logger.warning("The memory tier passes over %s: %s.", folder, problem)
            return []
        mine = [
            i
            for i in infos
            if i.state == COMMITTED
            and i.step is not None
            and i.name == f"{SNAPSHOT_PREFIX}{i.step}"
        ]
        return sorted(mine, key=lambda i: i.step or 0)

    def prune(self, keep: str) -> None:
        """Remove this process's snapshots but ``keep`` (the one being written) and the newest
        committed one."""
        committed = self.committed()
        kept = {os.path.basename(keep)} | ({committed[-1].name} if committed else set())
        self._remove(self.folder, lambda name: name not in kept)

    def discard_after(self, steps: int) -> None:
        """Remove this process's snapshots, and the copies it keeps, of a step after ``steps``:
        a load went back to ``steps`` (a rollback), and they belong to the trajectory it left."""

        def newer(name: str) -> bool:
            number = name[len(SNAPSHOT_PREFIX) :].split(".")[0]
            return name.startswith(SNAPSHOT_PREFIX) and number.isdigit() and int(number) > steps

        self._remove(self.folder, newer)
        self._remove(self.held_folder(), newer)

    @staticmethod
    def _remove(folder: str | None, which: Callable[[str], bool]) -> None:
        """Remove the entries of ``folder`` that ``which`` names (never through a link)."""
        if folder is None or os.path.islink(folder) or not os.path.isdir(folder):
            return
        for name in os.listdir(folder):
            if which(name):
                path = os.path.join(folder, name)
                if os.path.islink(path) or not os.path.isdir(path):
                    with contextlib.suppress(OSError):
                        os.remove(path)
                else:
                    shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ the Tier hooks

    def observer(self, automatic: bool) -> None:
        """A save of the project is nothing to this tier."""
        return None

    def hold(self) -> tuple[Collection[str], HoldBudget | None]:
        """Local retention keeps nothing back for this tier."""
        return (), None

    def resolve(
        self, sequence: LoadSequence, objects: TrainingObjects, local: Callable[[], LoadResult]
    ) -> LoadResult:
        """``load_state()`` without a folder, on every process: the newest snapshot every
        process has, if it is newer than the newest committed checkpoint on disk; else
        ``local()``."""
        if not self.options.every_steps:
            return local()  # the same on every process: no exchange
        mine = {info.step: info.path for info in self.committed() if info.step is not None}
        held_folder = self.held_folder()
        held = [i.step for i in self.committed(held_folder)] if held_folder else []
        # One exchange, and every process decides from the same lists.
        everyone = ops.gather_object([(sorted(mine), held, _newest_disk_step(sequence))])
        own = [set(entry[0]) for entry in everyone]
        kept_for = {
            held_source(r, self.world, self.local): set(entry[1])
            for r, entry in enumerate(everyone)
        }
        available = [own[q] | kept_for.get(q, set()) for q in range(len(everyone))]
        common = set.intersection(*available)
        on_disk = [entry[2] for entry in everyone if entry[2] is not None]
        disk = max(on_disk) if on_disk else None
        newer = sorted((step for step in common if disk is None or step > disk), reverse=True)
        for step in newer:
            path = mine.get(step) or self.snapshot_path(step)
            have = [step in steps for steps in own]
            if not all(have) and not self._fetched(step, have, path):
                continue
            try:
                result = sequence.run(path, objects)
            except CorruptCheckpointError as exc:  # agreed: every process falls back with us
                logger.warning(
                    "Not resuming from the memory snapshot of step %d: it is damaged (%s). "
                    "Trying the next older one, then the checkpoints on disk.",
                    step,
                    clip(str(exc), 2000),
                )
                continue
            if sequence.root is not None:  # where an uninterrupted run's counter is
                infos = list_checkpoints(self.storage_for(sequence.root), sequence.root)
                sequence.counter.set(next_iteration(infos))
            if self.rank == 0:
                logger.warning(
                    "load_state(): restored the memory snapshot of step %d (newer than %s on "
                    "disk).",
                    step,
                    "anything" if disk is None else f"step {disk}",
                )
            return dataclasses.replace(result, tier="memory")
        return local()

    def _fetched(self, step: int, have: list[bool], path: str) -> bool:
        """Bring back, from their holders, the snapshots of ``step`` some processes lost;
        whether every process has its own now (agreed)."""
        root = self.root
        assert root is not None
        error: str | None = None
        try:
            fetch_missing(root, self.rank, self.world, self.local, step, have, path)
        except (CorruptCheckpointError, OSError) as exc:
            error = f"process {self.rank}: {exc}"
        errors = [e for e in ops.gather_object([error]) if e is not None]
        if errors and self.rank == 0:
            logger.warning(
                "Not resuming from the memory snapshot of step %d: a peer's copy could not be "
                "brought back (%s). Trying the next older one, then the checkpoints on disk.",
                step,
                clip("; ".join(errors), 2000),
            )
        elif not errors and self.rank == 0:
            lost = [q for q, ok in enumerate(have) if not ok]
            logger.warning(
                "The memory snapshots of step %d of process(es) %s were gone: brought back "
                "from their peers' copies.",
                step,
                lost,
            )
        return not errors


def project_key(project_dir: str) -> str:
    """The folder name of ``project_dir``'s snapshots: a digest of its absolute path or URL."""
    location = project_dir if "://" in project_dir else os.path.abspath(project_dir)
    return "project-" + hashlib.sha256(location.encode()).hexdigest()[:16]


def _newest_disk_step(sequence: LoadSequence) -> int | None:
    """The step of the newest committed checkpoint under ``project_dir`` (``None``: none, or
    the folder cannot be listed, which the load below reports)."""
    if sequence.root is None:
        return None
    try:
        infos = loadable_automatic(
            list_checkpoints(sequence.storage_for(sequence.root), sequence.root)
        )
    except Exception:  # the tiers below list it again and say what failed
        return None
    steps = [i.step for i in infos if i.step is not None]
    return max(steps) if steps else None
