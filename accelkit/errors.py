"""The root of every exception accelkit raises, and the rule its families follow.

``except AccelkitError`` catches whatever accelkit itself raises, and nothing else. It lives in
this leaf module (rank 0 of the floor plan, importing nothing) so that every room can hang its
family under it without importing upwards; ``accelkit.AccelkitError`` is its public name.

The families, each defined in the room of its concern:

- :class:`~accelkit.checkpointing.errors.CheckpointError` -- a checkpoint cannot be saved,
  loaded, listed or deleted as asked; children: ``CorruptCheckpointError`` (a damaged or
  hostile file), ``CheckpointMismatchError`` (it does not fit the objects given),
  ``CheckpointPathError`` (the path given names no usable checkpoint).
- :class:`~accelkit.checkpointing.storage.StorageError` -- a storage failed in a way accelkit
  detected itself.
- :class:`~accelkit.trackers.TrackerError` -- a tracker failed (``on_error="raise"``).
- :class:`ConfigurationError` (here, as launching and the facade both raise it) -- a run's
  configuration cannot be used: a folder, a storage URL, a launch config file.

The rule for ``ValueError``: an exception is a ``ValueError`` only where it means that the
caller passed a bad argument -- as Accelerate raises ``ValueError`` for the same call, so that
a script's ``except ValueError`` keeps working (``ConfigurationError``,
``CheckpointMismatchError``, ``CheckpointPathError``). A failure of I/O, of a storage, of
another process or of a lock, and a damaged file, is never a ``ValueError``: ``except
ValueError`` around a load must not swallow a lost process or a failed upload. A storage
failure is also an ``OSError`` and a tracker failure a ``RuntimeError``, as before.
"""

from __future__ import annotations

__all__ = ["AccelkitError", "ConfigurationError"]


class AccelkitError(Exception):
    """The root of every exception accelkit raises; the message names the fix."""


class ConfigurationError(AccelkitError, ValueError):
    """The run's configuration cannot be used (a folder, a storage URL, a launch config file);
    the message names the value, what is wrong with it and the fix. A ``ValueError``: the
    caller passed it."""
