"""Checks made when an ``Accelerator`` is built, so a misconfigured run fails at once.

Without them a read-only logging directory makes every tracker fail (and be skipped) while
training goes on with nothing logged, and a ``project_dir`` that is a file, or an ``s3://`` URL
without ``s3fs``, fails only at the first ``save_state``, an epoch later. :func:`check_run`
looks at what can be looked at before the first step:

* the logging directory, when the run has trackers: the main process creates it and writes
  (and removes) a probe file in it;
* a local ``project_dir``: it is a folder, or can be created as one (the nearest existing
  parent is a writable folder); nothing is created;
* an fsspec ``project_dir`` URL: the package of its protocol is installed, and the storage
  answers (a failure to answer in time is only a warning: the storage may just be slow).

Only the main process looks; in a multi-process run its verdict is broadcast, so every process
raises the same :class:`ConfigurationError` at the same point (none is left waiting in a
collective for a process that has already failed). Whether there is anything to check depends
only on the arguments, which every process shares, so all of them take the broadcast or none.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import warnings
from typing import TYPE_CHECKING, Any

from accelkit._env import number
from accelkit.errors import ConfigurationError
from accelkit.runtime import ops

if TYPE_CHECKING:
    from accelkit.checkpointing.config import ProjectConfiguration
    from accelkit.runtime.state import PartialState

__all__ = ["ConfigurationError", "check_run", "logging_dir_problem", "project_dir_problem"]


def check_run(config: ProjectConfiguration, has_trackers: bool, state: PartialState) -> None:
    """Check the run's folders and storage on the main process; raise the verdict everywhere.

    Args:
        config: the run's ``ProjectConfiguration`` (``project_dir``, ``logging_dir``,
            ``storage_options``).
        has_trackers: whether ``log_with`` names any tracker (the same on every process).
        state: the process state (which process checks; whether others wait for the verdict).

    Raises:
        ConfigurationError: naming the path, what is wrong with it and the fix.
    """
    project_dir, storage_options = config.project_dir, config.storage_options
    local_logging_dir = _local(config.logging_dir) if has_trackers else None
    if project_dir is None and local_logging_dir is None:
        return
    problem: str | None = None
    if state.is_main_process:
        try:
            problem = _first_problem(project_dir, local_logging_dir, storage_options)
        except Exception as error:  # a check must never leave the other processes waiting
            problem = f"Checking the run's folders failed: {type(error).__name__}: {error}"
    if state.use_distributed:
        problem = ops.broadcast_object_list([problem], from_process=0)[0]
    if problem is not None:
        raise ConfigurationError(problem)


def _local(location: str | None) -> str | None:
    """The OS path of a local location; ``None`` for a URL of another storage."""
    if location is None:
        return None
    if location.startswith("file://"):
        return location[len("file://") :]
    return None if "://" in location else location


def _first_problem(
    project_dir: str | None, logging_dir: str | None, storage_options: dict[str, Any] | None
) -> str | None:
    if logging_dir is not None:
        problem = logging_dir_problem(logging_dir)
        if problem is not None:
            return problem
    if project_dir is not None and (logging_dir is None or _local(project_dir) != logging_dir):
        return project_dir_problem(project_dir, storage_options)
    return None


def logging_dir_problem(path: str) -> str | None:
    """Create the logging directory and write a probe file in it; what went wrong, if anything.

    Args:
        path: the local logging directory.

    Returns:
        ``None`` when trackers can write there, else a message naming the path and the fix.
    """
    fix = (
        "Trackers write their files there. Fix: pass a writable folder as logging_dir= "
        "(Accelerator(project_dir=...) or ProjectConfiguration(project_dir=..., logging_dir=...))."
    )
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".accelkit-probe-"):
            pass
    except OSError as error:
        return f"The logging directory {path!r} cannot be used: {_why(path, error)}. {fix}"
    return None


def project_dir_problem(
    project_dir: str, storage_options: dict[str, Any] | None = None
) -> str | None:
    """Whether checkpoints can be written under ``project_dir``; what is wrong, if anything.

    A local path must be a folder or creatable as one (nothing is created here); a URL's
    storage package must be installed and the storage must answer.

    Args:
        project_dir: a local path or an fsspec URL.
        storage_options: keyword arguments for the URL's fsspec filesystem.

    Returns:
        ``None`` when it looks usable, else a message naming the path and the fix.
    """
    local = _local(project_dir)
    if local is None:
        return _storage_problem(project_dir, storage_options)
    fix = "Fix: pass a folder you can write to as project_dir=."
    path = os.path.abspath(os.path.expanduser(local))
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == path else f"cannot be created: {existing!r} is a file"
        return f"project_dir {project_dir!r} {what}, not a folder. Checkpoints go under it. {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is not writable" if existing == path else f"cannot be created in {existing!r}"
        reason = "read-only file system" if _read_only(existing) else "permission denied"
        return f"project_dir {project_dir!r} {where} ({reason}). {fix}"
    return None


def _storage_problem(url: str, storage_options: dict[str, Any] | None) -> str | None:
    from accelkit.checkpointing.storage import get_storage

    try:
        storage = get_storage(url, storage_options)
    except ValueError as error:
        return f"project_dir {url!r} cannot be used: {error}"
    timeout = number("ACCELKIT_PREFLIGHT_TIMEOUT")
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            storage.exists(url)
            outcome.append(None)
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=probe, name="accelkit-preflight", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        warnings.warn(
            f"project_dir {url!r}: the storage did not answer within {timeout:g} s; going on, "
            "but the first save_state may fail. Check storage_options (endpoint_url, "
            "credentials) or raise ACCELKIT_PREFLIGHT_TIMEOUT (seconds).",
            UserWarning,
            stacklevel=4,
        )
        return None
    failure = outcome[0]
    if failure is None:
        return None
    return (
        f"project_dir {url!r} cannot be reached: {type(failure).__name__}: {failure}. Fix: check "
        "ProjectConfiguration(storage_options=...) (endpoint_url, key/secret or credentials) "
        "and that the bucket exists."
    )


def _why(path: str, error: OSError) -> str:
    if error.errno == errno.EEXIST or (error.errno == errno.ENOTDIR and os.path.isfile(path)):
        return "it is a file, not a folder"
    if error.errno == errno.ENOTDIR:
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        return f"{parent!r} is a file, so no folder can be created under it"
    if error.errno == errno.EROFS:
        return "it is on a read-only file system"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (not writable by this user)"
    return f"{type(error).__name__}: {error}"


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
