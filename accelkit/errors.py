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
- :class:`ConfigurationError` (here, as every room raises it) -- a setting or an argument
  cannot be used: a folder, a storage URL, a launch config file, a value out of its range.
- :class:`UsageError` (here, for the same reason) -- a call that cannot work in the state the
  run is in: a tracker logged to before it started, trackers started twice, CUDA initialised
  before a fork.
- :class:`WrongTypeError` and :class:`DependencyError` (here too) -- an argument of a type
  accelkit cannot use; a package that a feature needs cannot be imported.

The rule for ``ValueError``: an exception is a ``ValueError`` only where it means that the
caller passed a bad argument -- as Accelerate raises ``ValueError`` for the same call, so that
a script's ``except ValueError`` keeps working (``ConfigurationError``,
``CheckpointMismatchError``, ``CheckpointPathError``). A failure of I/O, of a storage, of
another process or of a lock, and a damaged file, is never a ``ValueError``: ``except
ValueError`` around a load must not swallow a lost process or a failed upload. A storage
failure is also an ``OSError`` and a tracker failure a ``RuntimeError``, as before. Each class
also subclasses the builtin that Python or Accelerate raises for the same case, so a script's
``except TypeError`` or ``except ImportError`` keeps working; accelkit itself raises no bare
builtin but where Python's protocols ask for one (``tests/test_errors_family.py`` keeps it so).

Warnings follow one rule too: they point at the user's line (:func:`warn_at_user_line`), never
into accelkit's files.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

__all__ = [
    "AccelkitError",
    "ConfigurationError",
    "DependencyError",
    "UsageError",
    "WrongTypeError",
    "warn_at_user_line",
]


class AccelkitError(Exception):
    """The root of every exception accelkit raises; the message names the fix."""


class ConfigurationError(AccelkitError, ValueError):
    """A setting or an argument cannot be used (a folder, a storage URL, a launch config file,
    a value out of its range); the message names the value, what is wrong with it and the fix.
    A ``ValueError``: the caller passed it, and Accelerate raises ``ValueError`` there."""


class UsageError(AccelkitError, RuntimeError):
    """A call that cannot work in the state the run or the object is in (before a start, a
    second start, a missing environment variable of a launch); the message names the call to
    make first. A ``RuntimeError``, as Python and Accelerate raise for such a call."""


class WrongTypeError(AccelkitError, TypeError):
    """An argument of a type accelkit cannot use (a class where an instance is wanted, a
    dataset where a ``DataLoader`` is); the message names the type found and the one wanted.
    A ``TypeError``, as Python raises, and not a ``ValueError``."""


class DependencyError(AccelkitError, ImportError):
    """A package that the feature asked for needs cannot be imported (not installed, or its
    plug-in fails to load); the message names the package and the ``pip install`` line. An
    ``ImportError``, as Python and Accelerate raise."""


def warn_at_user_line(message: str, category: type[Warning], *, where: str = "accelkit") -> None:
    """Warn at the first caller outside accelkit (and torch): the user's ``log()``,
    ``backward()`` or ``save_state()`` line, whichever entry point and wrappers led here.

    ``stacklevel`` cannot do this: the depth from the user's line differs per entry point. On a
    thread accelkit started (a tracker's worker) or in an ``atexit`` hook there is no user's
    line: the warning is then attributed to ``<where>``.

    Args:
        message: the warning's text.
        category: its class.
        where: the module name shown when no user's line is on the stack.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name in ("accelkit", "torch") or name.startswith(("accelkit.", "torch."))):
            break
        frame = frame.f_back
    if frame is None or frame.f_globals.get("__name__") == "threading":
        warnings.warn_explicit(message, category, f"<{where}>", 0, where)
        return
    module_globals = frame.f_globals
    # Without module_globals: a script run with ``python -m pkg.mod`` has a loader that cannot
    # give the source of ``__main__`` (ImportError inside warn_explicit); linecache reads the
    # file by its name instead.
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module_globals.get("__name__", "<string>"),
        module_globals.setdefault("__warningregistry__", {}),
    )
