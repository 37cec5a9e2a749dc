"""What a save writes: one process's share of a checkpoint, taken from the live objects.

:func:`capture_live` runs the save pre-hooks and takes this process's share (model weights and
object states on the main process, its random states on every process, its shards of sharded
FSDP models and their optimizers) as a :class:`LivePayload`: the live tensors, no copy, for a
synchronous save that writes them before training goes on. An asynchronous save copies the
same share into host buffers first
(:meth:`~accelkit.checkpointing.commit.snapshot.HostSnapshot.capture`), which gives a
:class:`~accelkit.checkpointing.commit.snapshot.FrozenSnapshot`; both are a :class:`Payload`, what
:class:`~accelkit.checkpointing.commit.protocol.SaveSequence` writes.

Public API: :class:`Payload`, :class:`LivePayload`, :func:`capture_live`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from accelkit.checkpointing.formats.manifest import FileEntry
from accelkit.checkpointing.objects.contents import (
    Snapshot,
    TrainingObjects,
    snapshot_contents,
    unwrap_model,
    write_snapshot,
)
from accelkit.checkpointing.sharded import sharded_targets, write_sharded
from accelkit.checkpointing.storage import Storage, WrittenFile

__all__ = ["LivePayload", "Payload", "capture_live"]


class Payload(Protocol):
    """One process's share of a checkpoint, ready to be written."""

    @property
    def has_sharded(self) -> bool:
        """Whether it holds sharded (FSDP) state, written by a collective of every process."""
        ...

    def write_sharded(self, storage: Storage, folder: str, group: Any) -> list[FileEntry]:
        """Write the sharded state into ``<folder>/sharded`` (DCP, on ``group``)."""
        ...

    def write(
        self, storage: Storage, folder: str, max_shard_size: int | str
    ) -> dict[str, WrittenFile]:
        """Write the other files; returns relative file name -> written file."""
        ...


@dataclass
class LivePayload:
    """This process's share as live objects (written before the save returns).

    Attributes:
        contents: model state dicts and object states (live tensors).
        sharded: the sharded state (from
            :meth:`~accelkit.checkpointing.sharded.ShardedTargets.state_dict`), or ``None``.
    """

    contents: Snapshot
    sharded: dict[str, Any] | None = None

    @property
    def has_sharded(self) -> bool:
        return self.sharded is not None

    def write_sharded(self, storage: Storage, folder: str, group: Any) -> list[FileEntry]:
        assert self.sharded is not None
        return write_sharded(storage, folder, self.sharded, group)

    def write(
        self, storage: Storage, folder: str, max_shard_size: int | str
    ) -> dict[str, WrittenFile]:
        return write_snapshot(storage, folder, self.contents, max_shard_size)


def capture_live(
    objects: TrainingObjects,
    hooks: Iterable[Callable[..., None]],
    folder: str,
    rank: int,
    is_main: bool,
) -> LivePayload:
    """Run the save pre-hooks and take this process's share of ``objects`` (no copy).

    Args:
        objects: what the run saves.
        hooks: ``hook(models, weights, folder)``; removing an entry of ``weights`` skips saving
            that model.
        folder: the checkpoint folder (given to the hooks).
        rank: this process's index.
        is_main: whether this process writes the shared files.
    """
    targets = sharded_targets(objects.models, objects.optimizers)
    sharded = targets.state_dict() if targets else None
    objects = targets.remaining(objects)  # the rest is saved as without FSDP
    models = list(objects.models)
    weights = [unwrap_model(m).state_dict() for m in models]
    for hook in list(hooks):
        hook(models, weights, folder)
    return LivePayload(snapshot_contents(objects, weights, rank, is_main), sharded)
