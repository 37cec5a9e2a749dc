"""Moved to :mod:`accelkit.checkpointing.formats.safetensors_io`; kept so old imports work."""

from __future__ import annotations

from accelkit.checkpointing.formats.safetensors_io import (
    check_expected,
    dtype_code,
    parse_size,
    read_safetensors,
    read_verified_bytes,
    supports_dtype,
    write_safetensors,
)

__all__ = [
    "check_expected",
    "dtype_code",
    "parse_size",
    "read_safetensors",
    "read_verified_bytes",
    "supports_dtype",
    "write_safetensors",
]
