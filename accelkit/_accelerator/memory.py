"""The memory tier's part of the :class:`~accelkit.Accelerator`: snapshots every
``ProjectConfiguration(memory_snapshot_every_steps=N)`` optimizer steps
(:class:`MemorySnapshots`).

The tier itself (where snapshots live, their rotation, the resolve of ``load_state()``) is
:mod:`accelkit.checkpointing.memory`; this part takes the snapshots, through the hooks the run
offers: a hook on the step boundaries (``GradientState.on_boundary``) that snapshots at the
save points of :class:`~accelkit.training.boundary.SavePoints` (where a preemption save would
be made: the state after a whole loop body, so a restart replays exactly what follows), the
checkpointing part's :meth:`~accelkit._accelerator.checkpointing.Checkpointing.save_snapshot`
(the asynchronous save into this process's folder) and its save observers (a load restarts the
count). On several processes each committed snapshot is also sent to a peer
(:class:`~accelkit.checkpointing.memory.peer.PeerCopies`, a thread on a gloo group of its
own). A snapshot that fails is logged and the run goes on; one refused before anything was
written (a sharded FSDP model, which per-process folders cannot hold) turns the tier off for the
run, on every process alike. See ``docs/guides/memory-tier.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from accelkit._text import clip
from accelkit.checkpointing.memory.peer import PeerCopies
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
        self.pending: AsyncCheckpoint | None = None
        self.peers: PeerCopies | None = None
        self._unhook: Callable[[], None] | None = None
        if not self.every:
            return
        if tier.folder is None:
            if state.is_main_process:
                logger.warning(
                    "memory_snapshot_every_steps=%d: no memory snapshots are taken: the job's "
                    "shared memory comes from `accelkit launch` (%s is not set, or its folder "
                    "is gone). Start the script with `accelkit launch`, or set "
                    "memory_snapshot_every_steps=None.",
                    self.every,
                    ENV_MEMORY_DIR,
                )
            return
        self.points = SavePoints(gradient_state)
        self._unhook = gradient_state.on_boundary.register(self.boundary)
        checkpointing.add_observer(self)
        self.peers = _peer_copies(tier, state)

    @property
    def active(self) -> bool:
        """Whether snapshots are being taken."""
        return self._unhook is not None

    def boundary(self, where: str, source: object) -> None:
        """The hook on the step boundaries: at a save point ``every`` optimizer steps after
        the last snapshot (or load), start the next snapshot."""
        if not self.points.reached(where, source):
            return
        steps = self.gradient_state.optimizer_steps
        if self.every is None or steps - self.last_step < self.every:
            return
        self.last_step = steps
        # The save in flight first: the script's own asynchronous save raises its failure
        # here, as at its next save_state; the previous snapshot's is claimed, reported below.
        self.checkpointing.wait_for_checkpoints()
        previous, self.pending = self.pending, None
        self._report(previous)
        path = self.tier.snapshot_path(steps)
        try:
            self.pending = self.checkpointing.save_snapshot(path)
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
        """A checkpoint of the project does not restart the count (it may be remote)."""

    def loaded(self, path: str, steps: int) -> None:
        """A load restarts the count from the loaded step."""
        self.last_step = steps


def _committed(handle: AsyncCheckpoint) -> Callable[[], str | None]:
    """What the peer-copy thread asks: the snapshot's folder once committed, ``None`` if it
    failed."""

    def committed() -> str | None:
        return handle.path if handle.exception() is None else None

    return committed


def _peer_copies(tier: MemoryTier, state: AcceleratorState) -> PeerCopies | None:
    """The peer copies of a run on several processes, on a gloo group of their own (created on
    every process alike: the tier is on everywhere or nowhere)."""
    root = tier.root
    if root is None or state.num_processes == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    group = dist.new_group(backend="gloo")
    local = getattr(state, "local_num_processes", state.num_processes)
    return PeerCopies(root, state.process_index, state.num_processes, local, group)
