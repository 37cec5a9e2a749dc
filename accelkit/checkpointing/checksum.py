"""Moved to :mod:`accelkit.checkpointing.storage.checksum`; kept so old imports work."""

from __future__ import annotations

from accelkit.checkpointing.storage.checksum import (
    DEFAULT_ALGORITHM,
    SUPPORTED_ALGORITHMS,
    Hasher,
    checksum_bytes,
    format_checksum,
    new_hasher,
    parse_checksum,
)

__all__ = [
    "DEFAULT_ALGORITHM",
    "Hasher",
    "SUPPORTED_ALGORITHMS",
    "checksum_bytes",
    "format_checksum",
    "new_hasher",
    "parse_checksum",
]
