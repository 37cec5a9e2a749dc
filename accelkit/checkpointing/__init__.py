"""Checkpoints: named, rotated, sharded, verified, on any fsspec storage, never half-written.

Modules, from the bottom up:

- :mod:`~accelkit.checkpointing.storage_base` -- the storage contract (``StorageProtocol``),
  the ``Storage`` base class, ``HashingWriter``.
- :mod:`~accelkit.checkpointing.storage_local` -- the local disk (``O_DIRECT``, fsync, rename).
- :mod:`~accelkit.checkpointing.storage_fsspec` -- any fsspec filesystem, S3 quirks apart; the
  only module that imports fsspec.
- :mod:`~accelkit.checkpointing.storage` -- ``get_storage``: the storage class of a URL's
  protocol; the public storage names.
- :mod:`~accelkit.checkpointing.confined` -- a read view of any storage that never follows a
  link inside a checkpoint.
- :mod:`~accelkit.checkpointing.checksum` -- streaming checksums (XXH3-128, SHA-256).
- :mod:`~accelkit.checkpointing.verified` -- the one verified read: size and checksum checked
  against a manifest entry while a file streams in.
- :mod:`~accelkit.checkpointing.jsonio` -- the one reader of JSON from a checkpoint (depth,
  numbers, errors naming the file).
- :mod:`~accelkit.checkpointing.layout` -- names of checkpoints and of their files.
- :mod:`~accelkit.checkpointing.manifest` -- ``accelkit.json``, the commit marker.
- :mod:`~accelkit.checkpointing.catalog` -- list checkpoints and tell their state.
- :mod:`~accelkit.checkpointing.retention` -- pure policy: which checkpoints to delete.
- :mod:`~accelkit.checkpointing.safetensors_header` -- the one safetensors header parser
  (no torch import).
- :mod:`~accelkit.checkpointing.safetensors_io` -- the safetensors format, streamed.
- :mod:`~accelkit.checkpointing.dcp_metadata` -- DCP's ``.metadata`` read with an exact
  allow-list, every field checked.
- :mod:`~accelkit.checkpointing.inspect` -- safetensors headers without loading tensors.
- :mod:`~accelkit.checkpointing.model_io` -- model weights, sharded; ``save_model`` and
  ``load_checkpoint_in_model``.
- :mod:`~accelkit.checkpointing.state_io` -- state dicts without pickle.
- :mod:`~accelkit.checkpointing.rng` -- random generator states.
- :mod:`~accelkit.checkpointing.sharded` -- sharded (FSDP2) state through DCP.
- :mod:`~accelkit.checkpointing.contents` -- what a training checkpoint holds.
- :mod:`~accelkit.checkpointing.loading` -- what ``load_state`` checks before restoring, and
  what it says when it cannot.
- :mod:`~accelkit.checkpointing.per_process` -- when each process saves into a folder of its
  own: whether that is allowed, and who may load such a folder.
- :mod:`~accelkit.checkpointing.lock` -- the project's save lock (saves and prunes).
- :mod:`~accelkit.checkpointing.deletion` -- un-commit, then remove (retention and prune).
- :mod:`~accelkit.checkpointing.payload` -- what a save writes, taken from the live objects.
- :mod:`~accelkit.checkpointing.snapshot` -- a reusable host-memory copy of the saved state.
- :mod:`~accelkit.checkpointing.protocol` -- the one commit sequence every save runs.
- :mod:`~accelkit.checkpointing.async_save` -- the background driver of that sequence.
- :mod:`~accelkit.checkpointing.manager` -- save / load / list / latest; the run's counter.
- :mod:`~accelkit.checkpointing.accelerate_format` -- Hugging Face accelerate's checkpoint
  folders, read safely (an exact allow-list for their pickles).
- :mod:`~accelkit.checkpointing.accelerate_import` -- convert such a folder into a committed
  accelkit checkpoint (``accelkit ckpt import``).
- :mod:`~accelkit.checkpointing.config` -- ``ProjectConfiguration``.
- :mod:`~accelkit.checkpointing.errors` -- the errors raised on bad checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr
from accelkit.checkpointing.config import ProjectConfiguration

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "CheckpointManager",
    "ProjectConfiguration",
    "RetentionPolicy",
    "load_checkpoint_in_model",
    "save_model",
]

_LAZY = {
    "AsyncCheckpoint": "accelkit.checkpointing.async_save",
    "CheckpointManager": "accelkit.checkpointing.manager",
    "CheckpointError": "accelkit.checkpointing.errors",
    "RetentionPolicy": "accelkit.checkpointing.retention",
    "load_checkpoint_in_model": "accelkit.checkpointing.model_io",
    "save_model": "accelkit.checkpointing.model_io",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

if TYPE_CHECKING:
    from accelkit.checkpointing.async_save import AsyncCheckpoint
    from accelkit.checkpointing.errors import CheckpointError
    from accelkit.checkpointing.manager import CheckpointManager
    from accelkit.checkpointing.model_io import load_checkpoint_in_model, save_model
    from accelkit.checkpointing.retention import RetentionPolicy
