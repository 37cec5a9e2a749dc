"""Errors raised when a checkpoint cannot be saved, loaded, listed or deleted.

Every message names the file (or key) at fault and what to do about it. The family hangs under
:class:`~accelkit.errors.AccelkitError`; which of its classes are also ``ValueError`` follows the
rule written in :mod:`accelkit.errors`: only those that mean "the caller passed a bad argument".
"""

from __future__ import annotations

from accelkit._text import clip
from accelkit.errors import AccelkitError

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointPathError",
    "CorruptCheckpointError",
    "ResumeMismatchError",
    "ResumeMismatchWarning",
    "UnresumedProjectWarning",
]


class CheckpointError(AccelkitError):
    """A checkpoint cannot be saved, loaded, listed or deleted as asked: raised as it is for a
    failure of another process, a storage or a lock, so it is not a ``ValueError``.

    Its text (``str(error)``, which tracebacks, logs and the ``accelkit`` command show) is
    printable and at most 4,000 characters: messages quote names and values read from a
    checkpoint, which may hold terminal escape sequences or list a crafted manifest's million
    files (:func:`accelkit._text.clip`). ``error.args[0]`` keeps the message as it was built.
    """

    def __str__(self) -> str:
        return clip(super().__str__())


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, damaged, missing, or disagrees with the manifest (a fault of the
    data read, not of an argument)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is intact but does not fit what it is loaded into (keys, world size,
    number of objects): the objects given are the bad argument."""


class CheckpointPathError(CheckpointError, ValueError):
    """The path given names no checkpoint that can be used as asked: nothing there, a file, a
    project folder, a save that never finished, a folder a new save may not take, folders that
    differ between processes. A ``ValueError``, as Accelerate raises for such a path."""


class ResumeMismatchError(CheckpointError, RuntimeError):
    """With ``Accelerator(strict_resume=True)``: the first step after ``load_state()`` would not
    consume what the saved run's next step would have (another data order, batch size, sampler,
    random stream or world size), so the resumed run would silently differ from an
    uninterrupted one. Raised on every process at that step, naming what differs and the fix.
    A ``RuntimeError``: the run, not an argument, is in the wrong state."""


class ResumeMismatchWarning(UserWarning):
    """The first step after ``load_state()`` does not consume what the saved run's next step
    would have (see :class:`ResumeMismatchError`, raised instead with
    ``Accelerator(strict_resume=True)``). Warned once, on the main process, naming what differs
    and on which processes."""


class UnresumedProjectWarning(UserWarning):
    """Training starts in a project that already holds checkpoints and nothing loaded one:
    the run's automatic names start again at ``checkpoint_0``, so its first save collides with
    an old checkpoint, or its checkpoints are the first that ``total_limit`` deletes. Warned
    once, on the main process, at the first ``backward()`` (or ``save_state()``); the message
    names the folder and the fixes (``load_state()``, a new ``project_dir``, or
    ``ProjectConfiguration(iteration=...)``)."""
