"""The run's checkpoint manager with its tiers composed: the one the ``Accelerator`` uses.

:class:`~accelkit.checkpointing.manager.CheckpointManager` knows one tier, ``project_dir``.
:class:`TieredCheckpointManager` composes with it, through the manager's
:class:`~accelkit.checkpointing.manager.Tier` hooks, the remote tier of
``ProjectConfiguration.replication``
(:class:`~accelkit.checkpointing.replication.tier.RemoteTier`: the replicator and its tier
record, the remote resolve of ``load_state()``, the local budget, the drain at the end of the
run), connects that tier to the run's listener (replication and budget-drop reports) and
offers its waits and its drain; and the memory tier of ``ProjectConfiguration.memory``
(:class:`~accelkit.checkpointing.memory.tier.MemoryTier`: snapshots in the job's shared memory,
resolved first). Without them, it is the manager alone.

Public API: :class:`TieredCheckpointManager`.
"""

from __future__ import annotations

from collections.abc import Callable

from accelkit.checkpointing.catalog.listing import CheckpointInfo
from accelkit.checkpointing.config import ProjectConfiguration
from accelkit.checkpointing.listener import DropReport
from accelkit.checkpointing.manager import CheckpointManager, ProcessInfo
from accelkit.checkpointing.memory.tier import MemoryTier
from accelkit.checkpointing.replication.replicator import ReplicationReport, Replicator
from accelkit.checkpointing.replication.tier import RemoteTier

__all__ = ["TieredCheckpointManager"]


class TieredCheckpointManager(CheckpointManager):
    """A :class:`~accelkit.checkpointing.manager.CheckpointManager` with the remote tier of
    ``ProjectConfiguration.replication`` composed (inert without ``replicate_to``).

    Args:
        config: the run's :class:`~accelkit.checkpointing.ProjectConfiguration`.
        state: this process's identity (an ``accelkit.runtime.state.PartialState``).

    Attributes:
        remote: the remote tier.
        memory: the memory tier.
    """

    def __init__(self, config: ProjectConfiguration, state: ProcessInfo) -> None:
        super().__init__(config, state)
        self.remote = RemoteTier(
            config, state.is_main_process, self.storage, self._on_replicated, self._dropped
        )
        self.add_tier(self.remote)
        # Added last: resolved first (a snapshot newer than every checkpoint on disk).
        self.memory = MemoryTier(
            config.memory,
            state.process_index,
            self.storage,
            world=state.num_processes,
            local=getattr(state, "local_num_processes", state.num_processes),
            project_dir=config.project_dir,
        )
        self.add_tier(self.memory)

    @property
    def replicator(self) -> Replicator | None:
        """The background replicator (main process, with ``replicate_to``), once started."""
        return self.remote.replicator

    def register_drain_deadline(self, deadline: Callable[[], float | None]) -> None:
        """Set how long the end of the run (``end_training()``, interpreter exit) drains the
        replication queue: ``deadline()`` is asked then, and its ``None`` means
        ``replicate_deadline_seconds``. The preemption part registers one that answers
        ``replicate_preemption_seconds`` once a preemption is pending: a job inside its grace
        period must not wait 300 s for a remote tier that is down."""
        self.remote.drain_deadline = deadline

    def wait_replicated(self, deadline: float | None = None) -> bool:
        """Wait up to ``deadline`` seconds (``None``: no limit) until every committed
        checkpoint of this run is on the remote tier (or was skipped by the queue policy).

        What a preemption exit calls: it says whether the newest checkpoint made it.

        Returns:
            ``True`` without ``replicate_to``, on processes other than the main one, or once the
            queue is drained; ``False`` if time ran out or a hard error stopped replication.
        """
        return self.remote.wait(deadline)

    def close_replication(self, deadline: float | None = None) -> list[str]:
        """Drain the replication queue for up to ``deadline`` seconds (default: the registered
        drain deadline, see :meth:`register_drain_deadline`, else ``replicate_deadline_seconds``)
        and stop the replicator; returns (and logs) the names of the checkpoints left behind. A
        later save starts a new replicator."""
        return self.remote.close(deadline)

    def _on_replicated(self) -> Callable[[ReplicationReport], None] | None:
        """What the replicator calls after each copy: the listener's report, if there is one."""
        listener = self._listener()
        return None if listener is None else listener.checkpoint_replicated

    def _dropped(self, info: CheckpointInfo) -> None:
        """Tell the listener that the disk budget deleted a checkpoint not yet replicated."""
        listener = self._listener()
        if listener is not None and info.manifest is not None:
            listener.checkpoint_dropped(DropReport(info.path, info.manifest, info.size_bytes))
