"""Errors raised when a checkpoint cannot be saved or loaded.

Every message names the file (or key) at fault and what to do about it.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded or saved as asked."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, damaged, missing, or disagrees with the manifest."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is intact but does not fit what it is loaded into (keys, world size,
    number of objects)."""
