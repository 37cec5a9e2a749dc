"""Moved to :mod:`accelkit.checkpointing.formats.state_io`; kept so old imports work."""

from __future__ import annotations

from accelkit.checkpointing.formats.state_io import (
    decode_state,
    encode_state,
    read_state,
    state_files,
    write_encoded,
    write_state,
)

__all__ = [
    "decode_state",
    "encode_state",
    "read_state",
    "state_files",
    "write_encoded",
    "write_state",
]
