"""``MemoryOptions``: the memory tier's settings (``ProjectConfiguration.memory``).

They live in the room of their concern so that the memory tier
(:mod:`~accelkit.checkpointing.memory.tier`) reads them without importing the configuration
above it; :class:`~accelkit.checkpointing.ProjectConfiguration` holds one and keeps the flat
name ``memory_snapshot_every_steps`` as an alias of its field.

Public API: :class:`MemoryOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryOptions"]


@dataclass
class MemoryOptions:
    """Snapshots of the whole training state in host memory, for restarts in seconds (see
    ``docs/guides/memory-tier.md``).

    Args:
        every_steps: take a snapshot every this many optimizer steps, at the step boundary
            where a preemption save would be made (a prepared dataloader asked for its next
            batch, no gradients accumulated). Each process writes its own complete checkpoint
            (model, optimizers, schedulers, random states, data positions, registered objects,
            with a manifest and checksums) into the job's shared memory, which ``accelkit
            launch`` keeps across the restarts of ``--max_restarts`` and removes when the job
            ends; the copy to host memory is the asynchronous save's, and the writing happens
            in the background. ``load_state()`` without a folder restores the newest snapshot
            every process has when it is newer than the newest checkpoint on disk. Needs a
            ``project_dir`` (the snapshots are the project's, as its checkpoints are). A
            snapshot is put off to the next save point while a save is still being written.
            ``None`` (the default): no snapshots. Flat alias: ``memory_snapshot_every_steps``.
    """

    every_steps: int | None = None
