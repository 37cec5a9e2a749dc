"""The reader of accelkit's own checkpoints, plugged into
:class:`~accelkit.checkpointing.restore.sequence.LoadSequence` for folders in state ``committed``.

- **check**: sharded (FSDP) state is loaded only into sharded models and the reverse
  (:func:`~accelkit.checkpointing.sharded.check_load_compatible`).
- **read**: :func:`~accelkit.checkpointing.objects.contents.read_contents` reads and checks the
  files of the objects that are not sharded (sizes and, with ``verify``, checksums against the
  manifest). A checkpoint saved by another number of processes loads: its weights and optimizer
  states are the same on every process, a dataloader position records the epoch's global
  place (see :mod:`accelkit.data.prepared`), and the random states of processes the saving run
  did not have are seeded from ``(step, iteration, rank)`` (deterministic, but not the
  continuation an equal process count gives), so such a load warns once, on the main process,
  naming the process count that continues bit for bit; for a dataloader position without the
  global record (an older checkpoint, a per-process count) the warning names its file.
- **apply**: the sharded state first, a collective that reshards to this run's process count
  (:func:`~accelkit.checkpointing.sharded.load_sharded`, which checks its files before DCP
  loads into the live parameters), then the rest
  (:func:`~accelkit.checkpointing.objects.contents.apply_contents`).

Public API: :class:`NativeReader`.
"""

from __future__ import annotations

import logging

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.objects.contents import (
    LoadedContents,
    TrainingObjects,
    apply_contents,
    read_contents,
)
from accelkit.checkpointing.objects.fingerprint import Fingerprint
from accelkit.checkpointing.restore.sequence import LoadSource
from accelkit.checkpointing.sharded import (
    ShardedTargets,
    check_load_compatible,
    load_sharded,
    sharded_targets,
)
from accelkit.data.position import GLOBAL_POSITION
from accelkit.data.random_streams import RandomStreams
from accelkit.errors import ConfigurationError

__all__ = ["NativeReader"]

logger = logging.getLogger(__name__)


class NativeReader:
    """Reads one committed accelkit checkpoint for one load (a
    :class:`~accelkit.checkpointing.restore.sequence.FolderReader`).

    Args:
        source: the checked folder; its ``info.manifest`` is set.
    """

    def __init__(self, source: LoadSource) -> None:
        manifest = source.info.manifest
        assert manifest is not None, "a committed checkpoint has a manifest"
        self.source = source
        self.manifest: Manifest = manifest
        self._targets: ShardedTargets | None = None
        self._plain = TrainingObjects()
        self._loaded = LoadedContents()

    def check(self, objects: TrainingObjects) -> None:
        """Refuse sharded state for unsharded models and the reverse.

        Raises:
            CheckpointMismatchError: naming what is missing and what to do.
        """
        source = self.source
        # From the objects as prepared, before the load pre-hooks: whether the run is sharded
        # is judged on what the user prepared, not on what a hook left in the list.
        targets = sharded_targets(objects.models, objects.optimizers)
        check_load_compatible(source.storage, source.path, targets)
        self._targets = targets

    def read(self, objects: TrainingObjects) -> None:
        """Read and check the files of every object that is not sharded; change nothing.

        Raises:
            CorruptCheckpointError / CheckpointMismatchError: see
                :func:`~accelkit.checkpointing.objects.contents.read_contents`.
        """
        assert self._targets is not None, "check() runs first"
        source = self.source
        self._plain = self._targets.remaining(objects)
        self._loaded = read_contents(
            source.storage, source.path, self.manifest, self._plain, source.rank, source.verify
        )
        self._check_loader_streams()
        if self.manifest.world_size != source.world_size and source.is_main:
            self._report_process_count()

    def _check_loader_streams(self) -> None:
        """Refuse, before anything is restored, a dataloader position whose saved generator
        states (``read_ahead_rng``, ``worker_rng``) cannot be put back: the file is damaged."""
        loaders = self._plain.dataloaders
        for obj, state, file in self._loaded.states:
            if isinstance(state, dict) and any(obj is loader for loader in loaders):
                try:
                    RandomStreams.checked(state)
                except ConfigurationError as exc:
                    raise CorruptCheckpointError(
                        f"{file}: {exc}; the file is damaged or was not written by accelkit. "
                        "Restore it from a copy, or load another checkpoint."
                    ) from None

    def _report_process_count(self) -> None:
        """Warn about a load on another number of processes: what it carries over, and, for an
        older checkpoint's per-process dataloader count, what it cannot."""
        source, saved = self.source, self.manifest.world_size
        loaders = self._plain.dataloaders
        per_process = [
            file
            for obj, state, file in self._loaded.states
            if any(obj is loader for loader in loaders)
            and isinstance(state, dict)
            and "batches_yielded" in state
            and GLOBAL_POSITION not in state
        ]
        if per_process:
            logger.warning(
                "%s was saved by %d process(es) and this run has %d, and its dataloader "
                "position (%s) is a per-process count from before accelkit recorded the "
                "epoch's global position: the resumed epoch may repeat or leave out samples. "
                "Resume with --num_processes %d for an exact continuation (checkpoints saved "
                "from now on resume exactly on any number of processes).",
                source.path,
                saved,
                source.world_size,
                ", ".join(per_process),
                saved,
            )
        else:
            logger.warning(
                "%s was saved by %d process(es) and this run has %d: the dataloaders continue "
                "the epoch at its global position (every sample once, in the saved order), but "
                "per-process random streams (dropout) cannot: processes without saved random "
                "states are seeded deterministically from the checkpoint and their rank. "
                "Resume with --num_processes %d for a bitwise continuation.",
                source.path,
                saved,
                source.world_size,
                saved,
            )

    @property
    def fingerprint(self) -> Fingerprint | None:
        """This process's resume fingerprint, once :meth:`read` ran (``None``: none saved)."""
        return self._loaded.fingerprint

    def apply(self) -> Manifest:
        """Load the sharded state (every process together), then restore the rest.

        Returns:
            The checkpoint's manifest.
        """
        assert self._targets is not None, "check() runs first"
        source = self.source
        if self._targets:
            load_sharded(source.storage, source.path, self._targets, self.manifest, source.verify)
        apply_contents(self._loaded, self._plain)
        return self.manifest
