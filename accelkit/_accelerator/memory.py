"""The memory tier's part of the :class:`~accelkit.Accelerator`: snapshots every
``ProjectConfiguration(memory_snapshot_every_steps=N)`` optimizer steps
(:class:`MemorySnapshots`).

The tier itself (where snapshots live, their rotation, the resolve of ``load_state()``) is
:mod:`accelkit.checkpointing.memory`; this part takes the snapshots, through the hooks the run
offers: a hook on the step boundaries (``GradientState.on_boundary``) that snapshots at the save
points of :class:`~accelkit.training.boundary.SavePoints` (where a preemption save would be
made: the state after a whole loop body, so a restart replays exactly what follows), the
checkpointing part's :meth:`~accelkit._accelerator.checkpointing.Checkpointing.save_snapshot`
(the asynchronous save into this process's folder) and its save observers (a load restarts the
count and removes the snapshots of later steps; a save is what the next snapshots record as the
last one, for the save decisions of a run restored from them). A snapshot is skipped, and tried
at the next save point, while any process still writes a save (agreed in one small all-reduce on
a gloo group of the tier's own): the step never waits for a write, and the script's own
asynchronous save raises its failure where it would without the tier. On several processes each
committed snapshot is also sent to a peer
(:class:`~accelkit.checkpointing.memory.peer.PeerCopies`, a thread on a gloo group of its own).
A snapshot that fails is logged and the run goes on; one refused before anything was written (a
sharded FSDP model, which per-process folders cannot hold) turns the tier off for the run, on
every process alike. See ``docs/guides/memory-tier.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from accelkit._text import clip
from accelkit.checkpointing.memory.peer import PeerCopies
from accelkit.checkpointing.memory.promote import record_project
from accelkit.errors import AccelkitError
from accelkit.runtime.job_memory import ENV_MEMORY_DIR
from accelkit.training.boundary import SavePoints

if TYPE_CHECKING:
    from accelkit._accelerator.checkpointing import Checkpointing
    from accelkit.checkpointing.commit.async_save import AsyncCheckpoint
    from accelkit.checkpointing.config import ProjectConfiguration
    from accelkit.checkpointing.memory.tier import MemoryTier
    from accelkit.runtime.state import AcceleratorState
    from accelkit.training.optim import GradientState

__all__ = ["MemorySnapshots"]

logger = logging.getLogger("accelkit.checkpointing.memory")

# A process's state at a snapshot point, worst last (the processes agree on the maximum).
_READY, _BUSY, _UNUSABLE = 0, 1, 2


class MemorySnapshots:
    """``ProjectConfiguration(memory=MemoryOptions(every_steps=N))`` for one run (see the
    module's docstring).

    Args:
        config: the run's configuration.
        state: this process's identity.
        gradient_state: the step state on whose boundaries the snapshots are taken.
        checkpointing: the saving part.
        tier: the run's memory tier (the manager's).

    Attributes:
        taken: the snapshots started so far by this process.
    """

    def __init__(
        self,
        config: ProjectConfiguration,
        state: AcceleratorState,
        gradient_state: GradientState,
        checkpointing: Checkpointing,
        tier: MemoryTier,
    ) -> None:
        self.every = config.memory.every_steps
        self.gradient_state = gradient_state
        self.checkpointing = checkpointing
        self.tier = tier
        self.taken = 0
        self.last_step = gradient_state.optimizer_steps
        self.last_save: int | None = None  # the run's newest checkpoint of the project
        self.pending: AsyncCheckpoint | None = None
        self.peers: PeerCopies | None = None
        self._unhook: Callable[[], None] | None = None
        self._warned_no_point = False
        self._is_main = state.is_main_process
        if not self.every:
            return
        if tier.folder is None:
            if state.is_main_process:
                logger.warning(
                    "memory_snapshot_every_steps=%d: no memory snapshots are taken: they need "
                    "a project_dir (load_state() finds them as it finds the project's "
                    "checkpoints) and the job's shared memory, which `accelkit launch` makes "
                    "(%s is not set, or its folder is gone). Set project_dir and start the "
                    "script with `accelkit launch`, or set memory_snapshot_every_steps=None.",
                    self.every,
                    ENV_MEMORY_DIR,
                )
            return
        if state.is_main_process and tier.root is not None and config.project_dir:
            try:  # what names the project to the launcher's promotion at a failed job's end
                record_project(tier.root, config.project_dir, state.num_processes)
            except OSError as exc:
                logger.warning(
                    "The memory tier could not record its project in %s (%s): a failed job's "
                    "newest snapshot will not be committed to disk at its end.",
                    tier.root,
                    exc,
                )
        self.points = SavePoints(gradient_state)
        self._unhook = gradient_state.on_boundary.register(self.boundary)
        checkpointing.add_observer(self)
        self._group = _gloo_group(state)  # the "is a save in flight?" agreement
        self.peers = _peer_copies(tier, state)

    @property
    def active(self) -> bool:
        """Whether snapshots are being taken."""
        return self._unhook is not None

    def boundary(self, where: str, source: object) -> None:
        """The hook on the step boundaries: at a save point ``every`` optimizer steps after
        the last snapshot (or load), start the next snapshot, unless a save is still being
        written on some process (the step never waits for one; the next save point tries
        again)."""
        point = self.points.reached(where, source)
        steps = self.gradient_state.optimizer_steps
        if self.every is None or steps - self.last_step < self.every:
            return
        if not point:
            self._no_save_point(steps)
            return
        state = self._agreed_state()
        if state == _UNUSABLE:
            self.close()
            logger.warning(
                "Memory snapshots are off for this run: a process's snapshot folder under %s "
                "is a link or a file, not a folder the tier made. Training goes on; restarts "
                "resume from the checkpoints on disk.",
                self.tier.root,
            )
            return
        if state == _BUSY:
            return
        self.last_step = steps
        previous, self.pending = self.pending, None
        self._report(previous)
        path = self.tier.snapshot_path(steps)
        try:
            self.pending = self.checkpointing.save_snapshot(path, self.last_save)
        except (AccelkitError, OSError) as exc:
            self.close()
            logger.warning(
                "Memory snapshots are off for this run: the snapshot of step %d was refused "
                "(%s). Training goes on; restarts resume from the checkpoints on disk.",
                steps,
                clip(str(exc), 2000),
            )
            return
        self.taken += 1
        self.tier.prune(keep=path)
        if self.peers is not None:
            self.peers.submit(_committed(self.pending), steps)

    def _agreed_state(self) -> int:
        """The worst of every process's state at a snapshot point (agreed: one small
        all-reduce, at snapshot points only): :data:`_UNUSABLE` (a snapshot folder that is a
        link or a file), :data:`_BUSY` (a save in flight, or a failure its script was not told
        of yet), else :data:`_READY`."""
        mine = (
            _UNUSABLE
            if not self.tier.usable()
            else _BUSY
            if self.checkpointing.save_in_flight()
            else _READY
        )
        if self._group is None:
            return mine
        import torch
        import torch.distributed as dist

        flag = torch.tensor([mine], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def _no_save_point(self, steps: int) -> None:
        """Say once when snapshots are overdue for want of a save point."""
        if self._warned_no_point or self.every is None or steps - self.last_step < 2 * self.every:
            return
        self._warned_no_point = True
        if self._is_main:
            logger.warning(
                "memory_snapshot_every_steps=%d: no snapshot since step %d (now %d): a snapshot "
                "is taken when a prepared dataloader is asked for its next batch after an "
                "optimizer step, with no gradients accumulated. Prepare the training "
                "dataloader with accelerator.prepare().",
                self.every,
                self.last_step,
                steps,
            )

    def close(self) -> None:
        """Take no more snapshots; finish the peer copies queued (``end_training()``)."""
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        peers, self.peers = self.peers, None
        if peers is not None:
            peers.close()

    @staticmethod
    def _report(handle: AsyncCheckpoint | None) -> None:
        """Log a finished snapshot's failure (the writer logged the details)."""
        if handle is None:
            return
        error = handle.exception()  # finished: the next save waited for it
        if error is not None:
            logger.warning(
                "The memory snapshot %s failed (%s); a restart resumes from the newest one "
                "that committed. Training goes on.",
                handle.path,
                clip(str(error), 2000),
            )

    # ------------------------------------------------------------------ save observer

    def reason(self, steps: int) -> str | None:
        """No opinion on why the script's saves are made."""
        return None

    def saved(self, reason: str, path: str, steps: int) -> None:
        """A checkpoint of the project: what the next snapshots record as the last save (it
        does not restart the count)."""
        self.last_save = steps

    def loaded(self, path: str, steps: int, saved: int | None) -> None:
        """A load restarts the count from the loaded step, and removes the snapshots of a
        later step (a rollback leaves their trajectory)."""
        self.last_step = steps
        self.last_save = saved
        self.tier.discard_after(steps)


def _committed(handle: AsyncCheckpoint) -> Callable[[], str | None]:
    """What the peer-copy thread asks: the snapshot's folder once committed, ``None`` if it
    failed."""

    def committed() -> str | None:
        return handle.path if handle.exception() is None else None

    return committed


def _gloo_group(state: AcceleratorState) -> object | None:
    """A gloo group of the memory tier's own (``None`` on one process), created on every
    process alike."""
    if state.num_processes == 1:
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def _peer_copies(tier: MemoryTier, state: AcceleratorState) -> PeerCopies | None:
    """The peer copies of a run on several processes, on a gloo group of their own (created on
    every process alike: the tier is on everywhere or nowhere)."""
    root = tier.root
    group = _gloo_group(state)
    if root is None or group is None:
        return None
    local = getattr(state, "local_num_processes", state.num_processes)
    return PeerCopies(root, state.process_index, state.num_processes, local, group)
