"""Local-first checkpoints replicated to a remote tier (issue #26).

A save commits to the local tier (``project_dir``) exactly as without replication; a
background :class:`~accelkit.checkpointing.replication.replicator.Replicator` copies each
committed checkpoint to ``replicate_to`` with
:func:`~accelkit.checkpointing.replication.copy.replicate_checkpoint` (the commit protocol a
second time: files verified against the manifest, the manifest written last), retrying storage
outages, and applies the remote retention policy under the remote run lock. ``accelkit ckpt
sync`` runs the same copy by hand. See ``docs/guides/replication.md``.

Public API: :class:`Replicator`, :class:`ReplicationReport`, :func:`replicate_checkpoint`,
:class:`Replicated`.
"""

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr

if TYPE_CHECKING:
    from accelkit.checkpointing.replication.copy import Replicated, replicate_checkpoint
    from accelkit.checkpointing.replication.replicator import ReplicationReport, Replicator

__all__ = ["Replicated", "ReplicationReport", "Replicator", "replicate_checkpoint"]

# Lazy: ``ProjectConfiguration`` imports this room's options (``replication.options``), and a
# configuration must not import torch through the copy path (``accelkit --help`` stays cheap).
_COPY = "accelkit.checkpointing.replication.copy"
_REPLICATOR = "accelkit.checkpointing.replication.replicator"
__getattr__ = lazy_getattr(
    __name__,
    {
        "Replicated": _COPY,
        "replicate_checkpoint": _COPY,
        "ReplicationReport": _REPLICATOR,
        "Replicator": _REPLICATOR,
    },
)
