"""The remote tier's side of replication: its listing, and one checkpoint's copy under its lock.

:class:`RemoteWriter` is what a
:class:`~accelkit.checkpointing.replication.replicator.Replicator`'s thread does to the remote
tier for one checkpoint: take the remote run lock
(:class:`~accelkit.checkpointing.commit.lock.RunLock`), copy the checkpoint with
:func:`~accelkit.checkpointing.replication.copy.replicate_checkpoint`, note it in the tier record
(:class:`~accelkit.checkpointing.replication.record.TierBook`), apply the remote retention policy
under the same lock (deletions as ``accelkit ckpt prune`` makes them), release the lock, and
list the remote tier again. Every storage call is retried with the shared backoff
(:func:`~accelkit.delivery.retry_call`) until the stop event is set; what is left raises, for the
replicator to classify (:func:`~accelkit.delivery.classify`) and report.

Public API: :class:`RemoteWriter`.
"""

from __future__ import annotations

import threading
import time

from accelkit.checkpointing.catalog.listing import (
    CheckpointInfo,
    committed_automatic,
    list_checkpoints,
)
from accelkit.checkpointing.catalog.retention import RetentionPolicy
from accelkit.checkpointing.commit.deletion import apply_retention
from accelkit.checkpointing.commit.lock import SAVE, RunLock
from accelkit.checkpointing.formats.layout import checkpoints_dir
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.replication.copy import Replicated, replicate_checkpoint
from accelkit.checkpointing.replication.record import TierBook
from accelkit.checkpointing.storage import Storage, join
from accelkit.delivery import RetryPolicy, retry_call

__all__ = ["RemoteWriter"]


class RemoteWriter:
    """Lists ``remote_project`` and copies local checkpoints into it, one at a time.

    Args:
        local: the storage of the local tier (the copy reads it).
        remote: the storage of the remote tier.
        remote_project: ``replicate_to``.
        policy: retention on the remote tier, applied after each copy under the run lock.
        retry: the backoff of transient errors.
        book: the tier record, noted after each copy and each listing.
        stop: once set, the retries stop waiting (and the copy stops between files).
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        remote_project: str,
        policy: RetentionPolicy,
        retry: RetryPolicy,
        book: TierBook,
        stop: threading.Event,
    ) -> None:
        self.local = local
        self.remote = remote
        self.remote_project = remote_project
        self.remote_root = checkpoints_dir(remote_project)
        self.policy = policy
        self.retry = retry
        self.book = book
        self.stop = stop

    def _sleep(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def list(self) -> list[CheckpointInfo]:
        """The automatic checkpoints committed on the remote tier (the tier record follows)."""
        infos = retry_call(
            lambda: committed_automatic(list_checkpoints(self.remote, self.remote_root)),
            self.retry,
            f"listing {self.remote_root}",
            should_stop=self.stop.is_set,
            sleep=self._sleep,
        )
        self.book.note_remote(infos)
        return infos

    def copy(self, name: str, path: str, manifest: Manifest) -> tuple[Replicated, float]:
        """Copy the local checkpoint ``path`` (``name``, of ``manifest``) and apply the remote
        retention, under the remote run lock.

        Returns:
            What the copy did, and the time (``time.time()``) of the remote commit.
        """
        lock = RunLock(self.remote, self.remote_project, role=SAVE)
        target = join(self.remote_root, name)
        retry_call(
            lock.acquire,
            self.retry,
            f"the lock of {self.remote_project}",
            should_stop=self.stop.is_set,
            sleep=self._sleep,
        )
        try:
            result = replicate_checkpoint(
                self.local,
                path,
                self.remote,
                target,
                self.retry,
                should_stop=self.stop.is_set,
                sleep=self._sleep,
            )
            committed_at = time.time()
            self.book.note_replicated(name, manifest, committed_at, result.already)
            apply_retention(self.remote, self.remote_root, self.policy, target)
        finally:
            lock.release()
        return result, committed_at
