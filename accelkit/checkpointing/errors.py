"""Errors raised when a checkpoint cannot be saved or loaded.

Every message names the file (or key) at fault and what to do about it.
"""

from __future__ import annotations

from accelkit._text import clip

__all__ = ["CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded or saved as asked.

    Its text (``str(error)``, which tracebacks, logs and the ``accelkit`` command show) is
    printable and at most 4,000 characters: messages quote names and values read from a
    checkpoint, which may hold terminal escape sequences or list a crafted manifest's million
    files (:func:`accelkit._text.clip`). ``error.args[0]`` keeps the message as it was built.
    """

    def __str__(self) -> str:
        return clip(super().__str__())


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, damaged, missing, or disagrees with the manifest."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is intact but does not fit what it is loaded into (keys, world size,
    number of objects)."""
