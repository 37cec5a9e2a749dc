"""How ``accelkit launch`` learns why a worker failed, to end with one line saying so.

A failing job prints every rank's traceback and torchrun's report; the line that matters
(``CheckpointError: ... No space left on device``) is buried. The launcher reads it from a
structured source instead of parsing that text:

* Each worker runs its script through :func:`run_script` (the start-up step of
  :mod:`accelkit.launch.signals` ``exec``\\ s it), which records an uncaught exception in the
  error file torchrun gives every worker (``TORCHELASTIC_ERROR_FILE``), in torch's own format
  (what ``torch.distributed.elastic.multiprocessing.errors.record`` writes), then lets Python
  print the traceback and exit 1 as usual.
* torchrun reads those files into its ``ChildFailedError``; :mod:`accelkit.launch._torchrun`
  writes the first failure (rank, exit code, message) to the file named by
  ``ACCELKIT_LAUNCH_FAILURE_FILE``. One local process has no torchrun: the launcher points
  ``TORCHELASTIC_ERROR_FILE`` at a file of its own and reads it as rank 0's.
* The launcher prints :func:`failure_line` after the job ended, as its last line.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from accelkit._text import escape
from accelkit.runtime.preemption import signal_name

__all__ = [
    "ENV_ERROR_FILE",
    "ENV_FAILURE_FILE",
    "Failure",
    "failure_line",
    "error_time_ns",
    "read_error_file",
    "read_failure",
    "run_script",
    "write_failure",
]

ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torch's name: set per worker by torchrun
ENV_FAILURE_FILE = "ACCELKIT_LAUNCH_FAILURE_FILE"
# Torch's format keeps whole seconds; a rank that fails because another one did (a peer that
# closed its connection) fails within milliseconds of it. The worker also records the time in
# nanoseconds under this key of ``extraInfo`` (torch ignores keys it does not know).
_TIME_NS_KEY = "accelkit_time_ns"
# A message can be a whole tensor repr or a server's HTML page: one line of sane length.
_MAX_MESSAGE = 400


@dataclass(frozen=True)
class Failure:
    """The first failure of a job: the global rank, its exit code and ``"Type: message"``."""

    rank: int
    exitcode: int
    message: str


def _script_frames(tb: TracebackType | None, script_file: str) -> TracebackType | None:
    """``tb`` from the first frame of the script on: the start-up and runpy frames are ours,
    and the traceback reads as ``python script.py`` would print it."""
    current = tb
    while current is not None:
        if current.tb_frame.f_code.co_filename == script_file:
            return current
        current = current.tb_next
    return tb  # not found (an exception while finding the module): keep every frame


def record_exception(exc: BaseException, tb: TracebackType | None = None) -> None:
    """Write ``exc`` to ``$TORCHELASTIC_ERROR_FILE`` in torch's format, unless that file exists
    (the script's own ``@record`` wrote it, maybe with more detail).

    Args:
        exc: the exception.
        tb: its traceback as it should be shown (default: ``exc.__traceback__``).
    """
    now_ns = time.time_ns()  # before anything else: the order of failures is what it is for
    path = os.environ.get(ENV_ERROR_FILE)
    if not path or os.path.exists(path):
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, tb or exc.__traceback__)
                ),
                "timestamp": str(now_ns // 1_000_000_000),
                _TIME_NS_KEY: str(now_ns),
            },
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary line is a convenience; the traceback is printed regardless


def run_script(mode: str, target: str, args: list[str]) -> None:
    """Run ``target`` as ``python -u target args`` (``mode="--python"``) or
    ``python -u -m target args`` (``mode="--module"``) would, in this process, recording an
    uncaught exception (see the module's docstring) before Python reports it.

    Call it from a ``python -u -c`` process, whose ``sys.path[0]`` is the current folder.
    """
    sys.argv = [target, *args]  # for a module, runpy then puts its file in argv[0]
    if mode == "--module":
        sys.path[0] = os.getcwd()  # as python -m does
        script_file = _module_file(target) or ""
    else:
        # As python does for a script: its own folder (links resolved) first on the path.
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        # Python 3.9+ gives __main__ (and its traceback lines) the script's absolute path.
        script_file = os.path.abspath(target)
    try:
        if mode == "--module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script_file, run_name="__main__")
    except SystemExit:
        raise  # the script chose its exit code: nothing to record
    except BaseException as exc:
        frames = _script_frames(exc.__traceback__, script_file)
        record_exception(exc, frames)
        # Python's own report (or the script's sys.excepthook), without our frames, and exit 1
        # as Python does after an uncaught exception. Ctrl-C is re-raised: the interpreter
        # then exits as it would for the script.
        if isinstance(exc, KeyboardInterrupt):
            raise
        # (Python 3.11 prints the exception's own __traceback__, whatever tb it is given.)
        sys.excepthook(type(exc), exc.with_traceback(frames), frames)
        sys.exit(1)


def _module_file(name: str) -> str | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        try:
            spec = importlib.util.find_spec(f"{name}.__main__")
        except (ImportError, ValueError):
            return None
    return None if spec is None else spec.origin


def read_error_file(path: str) -> str | None:
    """The ``"Type: message"`` of a torch error file, or None where there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        message = data["message"]
        message = message["message"] if isinstance(message, dict) else message
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) else None


def error_time_ns(path: str) -> int | None:
    """When the worker that wrote the torch error file at ``path`` failed, in nanoseconds since
    the epoch (this machine's clock), or None where there is no such file.

    A file accelkit's worker wrote carries the time to the nanosecond; one the script's own
    ``@record`` wrote carries whole seconds, so its modification time stands in for it (written
    once, when the worker failed).
    """
    try:
        with open(path, encoding="utf-8") as f:
            stamp = os.fstat(f.fileno()).st_mtime_ns
            data = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        precise = int(data["message"]["extraInfo"][_TIME_NS_KEY])
    except (KeyError, TypeError, ValueError):
        return stamp
    return precise if precise > 0 else stamp


def write_failure(path: str, failure: Failure) -> None:
    """Write ``failure`` for the launcher (see :func:`read_failure`)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(failure.__dict__, f)
    except OSError:
        pass


def read_failure(path: str) -> Failure | None:
    """The failure :func:`write_failure` wrote at ``path``, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
        return Failure(int(data["rank"]), int(data["exitcode"]), str(data["message"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def failure_line(failure: Failure) -> str:
    """One line: ``rank 1 failed: CheckpointError: ...`` (escaped, at most a few hundred
    characters), or the exit code / signal where the worker recorded no exception."""
    message = failure.message.strip()
    if not message:
        if failure.exitcode > 128:
            name = signal_name(failure.exitcode - 128)
            message = f"killed by {name} (exit code {failure.exitcode})"
        else:
            message = f"exit code {failure.exitcode}"
    message = escape(message)
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return f"rank {failure.rank} failed: {message}"
