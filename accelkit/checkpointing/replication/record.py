"""The replicator's bookkeeping of the local project's record of its remote tier.

:class:`TierBook` keeps :mod:`~accelkit.checkpointing.formats.tier_record`'s file
(``.accelkit-replication.json``: the location without credentials, each checkpoint committed
there with its local and remote commit times) true while a
:class:`~accelkit.checkpointing.replication.replicator.Replicator` runs: written when it opens,
after each remote commit and when the remote listing changes. ``accelkit ckpt ls`` reads it for
its TIER and LAG columns. The record is for display: a failure to read it starts a new one (said
at info level), a failure to write it is logged once (:class:`~accelkit.delivery.ReportOnce`),
and neither is ever fatal.

Public API: :class:`TierBook`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from accelkit.checkpointing.catalog.listing import CheckpointInfo
from accelkit.checkpointing.formats.layout import checkpoints_dir
from accelkit.checkpointing.formats.manifest import Manifest, read_manifest
from accelkit.checkpointing.formats.tier_record import (
    TierEntry,
    TierRecord,
    public_location,
    read_record,
    write_record,
)
from accelkit.checkpointing.replication.copy import same_checkpoint
from accelkit.checkpointing.storage import Storage, join
from accelkit.delivery import ReportOnce

__all__ = ["TierBook"]

logger = logging.getLogger(__name__)


class TierBook:
    """The record of ``remote_project`` kept in ``local_project`` (not thread-safe: the
    replicator's thread is its one writer).

    Args:
        local: the storage of the local tier.
        local_project: the local ``project_dir`` (the record sits there).
        remote_project: the remote tier's location (recorded without credentials).
    """

    def __init__(self, local: Storage, local_project: str, remote_project: str) -> None:
        self.local = local
        self.local_project = local_project
        self.local_root = checkpoints_dir(local_project)
        self.remote_project = remote_project
        self.record: TierRecord | None = None
        """The record, once :meth:`open` loaded or started it."""
        self._reported = ReportOnce()

    def open(self) -> None:
        """Load the local project's record of its remote tier (or start one) and write it,
        so that ``accelkit ckpt ls`` knows the remote tier from the first save on."""
        location = public_location(self.remote_project)
        try:
            record = read_record(self.local, self.local_project)
        except Exception as exc:
            logger.info("Replication starts a new %s: %s", "tier record", exc)
            record = None
        if record is None or record.replicate_to != location:
            record = TierRecord(location)
        self.record = record
        self._save()

    def note_remote(self, infos: Sequence[CheckpointInfo]) -> None:
        """Keep the record's checkpoints to those committed on the remote tier (an earlier
        copy whose time is unknown is recorded without one)."""
        record = self.record
        if record is None:
            return
        there = {info.name: info for info in infos}
        before = dict(record.checkpoints)
        record.checkpoints = {n: e for n, e in before.items() if n in there}
        for name, info in there.items():
            if name not in record.checkpoints and self._local_twin(info):
                record.checkpoints[name] = TierEntry(info.created, None)
        if record.checkpoints != before:
            self._save()

    def note_replicated(self, name: str, manifest: Manifest, at: float, already: bool) -> None:
        """Record ``name`` (of local ``manifest``) committed on the remote tier at ``at``; one
        found there ``already`` keeps its entry, or is recorded without a time."""
        record = self.record
        if record is None:
            return
        if already and name in record.checkpoints:
            return
        record.checkpoints[name] = TierEntry(manifest.created, None if already else at)
        self._save()

    def _local_twin(self, info: CheckpointInfo) -> bool:
        """Whether the remote checkpoint ``info`` is the local one of its name, compared by
        content (or the local tier has none of that name: it is on the remote tier only)."""
        if info.manifest is None:
            return False
        try:
            local = read_manifest(self.local, join(self.local_root, info.name))
        except Exception:  # a damaged local one: not the same checkpoint
            return False
        return local is None or same_checkpoint(local, info.manifest)

    def _save(self) -> None:
        record = self.record
        if record is None:
            return
        record.updated = time.time()
        try:
            write_record(self.local, self.local_project, record)
        except Exception as exc:  # the record is for display: never fatal
            if self._reported.first("write"):
                logger.warning(
                    "Replication could not write its record under %s: %s. `accelkit ckpt ls` "
                    "then needs --remote to show the tiers.",
                    self.local_project,
                    exc,
                )
