"""Checkpoints: named, rotated, sharded, verified, on any fsspec storage, never half-written.

Layers, bottom up; each imports only from the layers below it (and from
:mod:`~accelkit.checkpointing.errors`, a leaf every layer may raise from).

**Storage** -- bytes in and out of any location; knows nothing of checkpoints:

- :mod:`~accelkit.checkpointing.storage` -- ``get_storage``: the storage class of a URL's
  protocol; the public storage names.
- :mod:`~accelkit.checkpointing.storage.checksum` -- streaming checksums (XXH3-128, SHA-256).
- :mod:`~accelkit.checkpointing.storage.base` -- the storage contract: the ``Storage`` base
  class every storage subclasses and the checkpoint code is typed with; ``HashingWriter``.
- :mod:`~accelkit.checkpointing.storage.local` -- the local disk (``O_DIRECT``, fsync, rename).
- :mod:`~accelkit.checkpointing.storage.fsspec` -- any fsspec filesystem, S3 quirks apart; the
  only module that imports fsspec.
- :mod:`~accelkit.checkpointing.storage.confined` -- a read view of any storage that never
  follows a link inside a checkpoint.
- :mod:`~accelkit.checkpointing.storage.verified` -- the one verified read: size and checksum
  checked against an expected entry while a file streams in.
- :mod:`~accelkit.checkpointing.storage.retry` -- transient storage errors told from hard ones,
  retried with backoff and jitter (``RetryingStorage``; the classifier and ``RetryPolicy`` are
  :mod:`accelkit.delivery`'s, shared with replication and the trackers).

**Formats** -- what the files of a checkpoint are called and what they hold:

- :mod:`~accelkit.checkpointing.formats` -- the layer's face (no names of its own).
- :mod:`~accelkit.checkpointing.formats.layout` -- names of checkpoints and of their files.
- :mod:`~accelkit.checkpointing.formats.jsonio` -- the one reader of JSON from a checkpoint
  (depth, numbers, errors naming the file).
- :mod:`~accelkit.checkpointing.formats.safetensors_header` -- the one safetensors header
  parser (no torch import).
- :mod:`~accelkit.checkpointing.formats.safetensors_io` -- the safetensors format, streamed.
- :mod:`~accelkit.checkpointing.formats.dcp_metadata` -- DCP's ``.metadata`` read with an exact
  allow-list, every field checked.
- :mod:`~accelkit.checkpointing.formats.dcp_chunks` -- where each tensor of DCP's sharded
  state lies (chunks, files, byte ranges), checked; one chunk read from its byte range.
- :mod:`~accelkit.checkpointing.formats.state_io` -- state dicts without pickle.
- :mod:`~accelkit.checkpointing.formats.model_io` -- model weights, sharded; ``save_model`` and
  ``load_checkpoint_in_model``.
- :mod:`~accelkit.checkpointing.formats.manifest` -- ``accelkit.json``, the commit marker and
  table of contents.
- :mod:`~accelkit.checkpointing.formats.tier_record` -- ``.accelkit-replication.json``, a
  project's record of its remote tier (location, replicated checkpoints, lag).

**Sharded state** -- FSDP2 state through DCP:

- :mod:`~accelkit.checkpointing.sharded` -- its public names (``save_sharded``,
  ``load_sharded``...).
- :mod:`~accelkit.checkpointing.sharded.state` -- save, load and check sharded state.

**Training objects** -- what a checkpoint captures from the live objects and gives back:

- :mod:`~accelkit.checkpointing.objects` -- the layer's face (no names of its own).
- :mod:`~accelkit.checkpointing.objects.rng` -- random generator states.
- :mod:`~accelkit.checkpointing.objects.contents` -- what a training checkpoint holds.
- :mod:`~accelkit.checkpointing.objects.fingerprint` -- the resume fingerprint: a record of what
  one process's next steps consume, compared at the first step after a resume.

**Catalog** -- the checkpoints of a project as a list, and what to keep of them:

- :mod:`~accelkit.checkpointing.catalog` -- the layer's face (no names of its own).
- :mod:`~accelkit.checkpointing.catalog.retention` -- pure policy: which checkpoints to delete.
- :mod:`~accelkit.checkpointing.catalog.listing` -- list checkpoints and tell their state.
- :mod:`~accelkit.checkpointing.catalog.inspect` -- safetensors headers without loading tensors.
- :mod:`~accelkit.checkpointing.catalog.diff` -- two checkpoints compared, tensor by tensor
  (read ahead in pieces, A and B side by side).
- :mod:`~accelkit.checkpointing.catalog.lineage` -- the lines of descent forks start (what
  ``ckpt ls --tree`` draws), and the parent record a fork writes.

**Restore** -- the load sequence:

- :mod:`~accelkit.checkpointing.restore` -- the layer's face (no names of its own).
- :mod:`~accelkit.checkpointing.restore.loading` -- what ``load_state`` checks before restoring,
  and what it says when it cannot.
- :mod:`~accelkit.checkpointing.restore.sequence` -- the one load sequence every ``load_state``
  runs (resolve, confine, check, read, agree, apply, counter, meet); readers plug into it.
- :mod:`~accelkit.checkpointing.restore.native` -- the reader of accelkit's own checkpoints.

**Commit** -- the save sequence, its driver and what it writes:

- :mod:`~accelkit.checkpointing.commit` -- the layer's face (no names of its own).
- :mod:`~accelkit.checkpointing.commit.lock` -- the project's save lock (saves, imports, prunes).
- :mod:`~accelkit.checkpointing.commit.deletion` -- un-commit, then remove (retention and prune).
- :mod:`~accelkit.checkpointing.commit.per_process` -- when each process saves into a folder of
  its own: whether that is allowed, and who may load such a folder.
- :mod:`~accelkit.checkpointing.commit.payload` -- what a save writes, taken from the live objects.
- :mod:`~accelkit.checkpointing.commit.snapshot` -- a reusable host-memory copy of the saved state.
- :mod:`~accelkit.checkpointing.commit.protocol` -- the one commit sequence every save runs.
- :mod:`~accelkit.checkpointing.commit.async_save` -- the background driver of that sequence.
- :mod:`~accelkit.checkpointing.commit.writer_process` -- the writer process of asynchronous
  saves and its shared-memory snapshot buffers.

**Replication** -- the remote tier of ``replicate_to``:

- :mod:`~accelkit.checkpointing.replication` -- its public names.
- :mod:`~accelkit.checkpointing.replication.copy` -- the one copy of a committed checkpoint to
  another tier (verified reads, the manifest last).
- :mod:`~accelkit.checkpointing.replication.options` -- ``ReplicationOptions``, the remote
  tier's settings (``ProjectConfiguration.replication``).
- :mod:`~accelkit.checkpointing.replication.record` -- ``TierBook``, the replicator's upkeep of
  the tier record (``.accelkit-replication.json``).
- :mod:`~accelkit.checkpointing.replication.remote` -- ``RemoteWriter``, one checkpoint's copy
  and the remote retention under the remote run lock, and the remote listing.
- :mod:`~accelkit.checkpointing.replication.replicator` -- the background thread and its bounded
  queue.
- :mod:`~accelkit.checkpointing.replication.tier` -- the remote tier the manager composes
  (``RemoteTier``): the replicator, the remote resolve of ``load_state()``, the local budget,
  the drain at the end of the run.

**Memory** -- the memory tier of ``memory_snapshot_every_steps``:

- :mod:`~accelkit.checkpointing.memory` -- the tier's map (no names of its own).
- :mod:`~accelkit.checkpointing.memory.options` -- ``MemoryOptions``, the memory tier's
  settings (``ProjectConfiguration.memory``).
- :mod:`~accelkit.checkpointing.memory.peer` -- each snapshot copied to a peer one machine
  along a ring (``PeerCopies``), and brought back at a restore.
- :mod:`~accelkit.checkpointing.memory.promote` -- a failed job's newest snapshots committed
  to disk before its memory goes (``promote_snapshots``; ``accelkit launch`` runs it).
- :mod:`~accelkit.checkpointing.memory.tier` -- the memory tier the manager composes
  (``MemoryTier``): each process's snapshots in the job's shared memory, their rotation, the
  agreed resolve of ``load_state()``.

**Interop** -- Hugging Face accelerate's checkpoint folders, and Hugging Face's model files:

- :mod:`~accelkit.checkpointing.interop` -- the layer's face (no names of its own).
- :mod:`~accelkit.checkpointing.interop.accelerate_pickle` -- accelerate's pickles, read as
  data (allow-list, a scan on stand-ins, a weights-only load, a walk of what it built).
- :mod:`~accelkit.checkpointing.interop.accelerate_format` -- accelerate's folders, read safely
  (each value checked for its shape); the load sequence's reader for them.
- :mod:`~accelkit.checkpointing.interop.accelerate_import` -- convert such a folder into a
  committed accelkit checkpoint (``accelkit ckpt import``).
- :mod:`~accelkit.checkpointing.interop.hf_export` -- a checkpoint's model written as Hugging
  Face safetensors files, streamed and verified (``accelkit ckpt export``).

**The top** -- what the rest of accelkit talks to:

- :mod:`~accelkit.checkpointing.errors` -- the errors raised on bad checkpoints.
- :mod:`~accelkit.checkpointing.config` -- ``ProjectConfiguration`` and its options objects
  (``RetentionOptions``, ``SaveOptions``, ``AsyncOptions``, ``ReplicationOptions``,
  ``PreemptionOptions``, ``MemoryOptions``).
- :mod:`~accelkit.checkpointing.listener` -- what the manager tells the rest of the run
  (``CheckpointListener``: the manifest's ``experiment`` record, commits, loads).
- :mod:`~accelkit.checkpointing.manager` -- save / load / list / latest; the run's counter;
  the hooks further tiers compose through (``Tier``).
- :mod:`~accelkit.checkpointing.tiered` -- the manager with the remote and memory tiers
  composed (``TieredCheckpointManager``), what the ``Accelerator`` uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr
from accelkit.checkpointing.config import (
    AsyncOptions,
    MemoryOptions,
    PreemptionOptions,
    ProjectConfiguration,
    ReplicationOptions,
    RetentionOptions,
    SaveOptions,
)

__all__ = [
    "AsyncCheckpoint",
    "AsyncOptions",
    "CheckpointError",
    "CheckpointManager",
    "MemoryOptions",
    "PreemptionOptions",
    "ProjectConfiguration",
    "ReplicationOptions",
    "RetentionOptions",
    "RetentionPolicy",
    "SaveOptions",
    "TieredCheckpointManager",
    "load_checkpoint_in_model",
    "save_model",
]

_LAZY = {
    "AsyncCheckpoint": "accelkit.checkpointing.commit.async_save",
    "CheckpointManager": "accelkit.checkpointing.manager",
    "CheckpointError": "accelkit.checkpointing.errors",
    "RetentionPolicy": "accelkit.checkpointing.catalog.retention",
    "load_checkpoint_in_model": "accelkit.checkpointing.formats.model_io",
    "save_model": "accelkit.checkpointing.formats.model_io",
    "TieredCheckpointManager": "accelkit.checkpointing.tiered",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

if TYPE_CHECKING:
    from accelkit.checkpointing.catalog.retention import RetentionPolicy
    from accelkit.checkpointing.commit.async_save import AsyncCheckpoint
    from accelkit.checkpointing.errors import CheckpointError
    from accelkit.checkpointing.formats.model_io import load_checkpoint_in_model, save_model
    from accelkit.checkpointing.manager import CheckpointManager
    from accelkit.checkpointing.tiered import TieredCheckpointManager
