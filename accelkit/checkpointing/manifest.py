"""Moved to :mod:`accelkit.checkpointing.formats.manifest`; kept so old imports work."""

from __future__ import annotations

from accelkit.checkpointing.formats.manifest import (
    FORMAT_VERSION,
    FileEntry,
    FileProblem,
    Manifest,
    ManifestError,
    file_checksum,
    read_manifest,
    verify_files,
    write_manifest,
)

__all__ = [
    "FORMAT_VERSION",
    "FileEntry",
    "FileProblem",
    "Manifest",
    "ManifestError",
    "file_checksum",
    "read_manifest",
    "verify_files",
    "write_manifest",
]
