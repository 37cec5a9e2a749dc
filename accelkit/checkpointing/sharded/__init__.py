"""Sharded (FSDP2) model and optimizer state, through ``torch.distributed.checkpoint`` (DCP).

The layer between the file formats and the commit protocol: it writes and reads the
``sharded/`` subfolder of a checkpoint through :mod:`accelkit.checkpointing.storage`, with
DCP's index read by :mod:`accelkit.checkpointing.formats.dcp_metadata`.

- :mod:`~accelkit.checkpointing.sharded.state` -- save, load and check sharded state (the names
  below).
- :mod:`~accelkit.checkpointing.sharded._dcp_storage` -- DCP's file system, writer, reader and
  planner over a :class:`~accelkit.checkpointing.storage.Storage` (imported lazily: DCP takes
  seconds to import).
"""

from __future__ import annotations

from accelkit.checkpointing.sharded.state import (
    DCP_METADATA_NAME,
    SHARDED_DIRNAME,
    ShardedTargets,
    check_load_compatible,
    clear_sharded,
    has_sharded_state,
    list_sharded_tensors,
    load_sharded,
    read_sharded_metadata,
    save_sharded,
    sharded_targets,
    sharded_tensor_infos,
    write_sharded,
)

__all__ = [
    "DCP_METADATA_NAME",
    "SHARDED_DIRNAME",
    "ShardedTargets",
    "check_load_compatible",
    "clear_sharded",
    "has_sharded_state",
    "list_sharded_tensors",
    "load_sharded",
    "read_sharded_metadata",
    "save_sharded",
    "sharded_targets",
    "sharded_tensor_infos",
    "write_sharded",
]
