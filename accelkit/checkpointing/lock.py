"""The save lock: one process at a time saves automatic checkpoints into a ``project_dir``.

Two runs pointed at the same ``project_dir`` would otherwise race for the same
``checkpoint_<n>`` name, write into one folder and commit a mix of both. Every automatic save
takes ``<project_dir>/.accelkit-run.lock`` (JSON: host, pid, process start time, a random
token) before it claims its folder, and gives it back once the checkpoint is committed and
retention has run. A save that finds the lock held by another live process is refused with a
:class:`~accelkit.checkpointing.errors.CheckpointError` naming the holder and the fix; under
the lock, a folder name that already exists is refused too (accelkit never overwrites an
automatic checkpoint), so of two runs saving into one project the second is refused at its
first colliding save and neither checkpoint is corrupted.

A lock is *stale*, and taken over, when its process is gone: on the same host, its pid no longer
runs (or is a zombie, or now belongs to a process started at another time); on another host,
it is older than :data:`STALE_AFTER_S` seconds (a host cannot see another host's processes). A
run killed in the middle of a save therefore resumes without any manual step.

The lock is created with :meth:`~accelkit.checkpointing.storage.Storage.create_exclusive`:
atomic on a local disk (``O_EXCL``) and on object stores that honour a conditional PUT
(``If-None-Match: *``: AWS S3, SeaweedFS). Where a store ignores the condition, the lock is read
back and the last writer wins, which leaves a window of a fraction of a second.

Public API: :data:`LOCK_NAME`, :data:`STALE_AFTER_S`, :class:`RunLock` (``acquire()``,
``release()``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from typing import Any

from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.jsonio import load_json
from accelkit.checkpointing.storage import Storage, join

__all__ = ["LOCK_NAME", "STALE_AFTER_S", "RunLock"]

LOCK_NAME = ".accelkit-run.lock"
STALE_AFTER_S = float(os.environ.get("ACCELKIT_LOCK_STALE_S", "3600"))


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot, from /proc), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == b"Z":  # a zombie has exited; only its exit status is left
        return "zombie"
    return fields[19].decode()


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    now = _start_time(pid)
    if now == "zombie":
        return False
    return started is None or now is None or now == started


class RunLock:
    """The save lock of one project, as seen from this process.

    Args:
        storage: the storage of ``project_dir``.
        project_dir: the run's project folder (local path or URL).
    """

    def __init__(self, storage: Storage, project_dir: str) -> None:
        self.storage = storage
        self.root = project_dir
        self.url = join(project_dir, LOCK_NAME)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started = _start_time(self.pid)
        self.token = uuid.uuid4().hex

    def _payload(self) -> bytes:
        data = {
            "host": self.host,
            "pid": self.pid,
            "started": self.started,
            "token": self.token,
            "updated": time.time(),
        }
        return json.dumps(data).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            data = load_json(self.storage.read_bytes(self.url), self.url, max_depth=2)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:
            return {}  # unreadable: treated as stale
        if not isinstance(data, dict):
            return {}
        # Fields of an unexpected type or range (a damaged or planted file) count as absent.
        pid, updated = data.get("pid"), data.get("updated")
        if not (type(pid) is int and 0 < pid < 2**31):
            data.pop("pid", None)
        if not (isinstance(updated, (int, float)) and 0 <= updated < 1e11):
            data.pop("updated", None)
        return data

    def _ours(self, holder: dict[str, Any]) -> bool:
        # The same process (another Accelerator in a notebook, a test) shares the lock.
        return holder.get("host") == self.host and holder.get("pid") == self.pid

    def _stale(self, holder: dict[str, Any]) -> bool:
        pid = holder.get("pid")
        if holder.get("host") == self.host and isinstance(pid, int):
            started = holder.get("started")
            return not _alive(pid, started if isinstance(started, str) else None)
        updated = holder.get("updated")
        if not isinstance(updated, (int, float)):
            return True
        return time.time() - float(updated) > STALE_AFTER_S

    def _refuse(self, holder: dict[str, Any]) -> CheckpointError:
        since = holder.get("updated")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
            if isinstance(since, (int, float))
            else "an unknown time"
        )
        return CheckpointError(
            f"{self.root} is in use by another run (pid {holder.get('pid')} on host "
            f"{holder.get('host')!r} is saving a checkpoint there since {when}): two runs "
            "saving automatic checkpoints into one project_dir would overwrite each other's "
            "checkpoints. Give this run its own project_dir; if that run is gone (e.g. it ran "
            f"on another machine), delete {self.url} and save again."
        )

    def acquire(self) -> None:
        """Take the lock before a save.

        Raises:
            CheckpointError: another live run holds it.
        """
        self.storage.makedirs(self.root)
        for _ in range(3):
            holder = self._read()
            if holder is not None and not self._ours(holder):
                if not self._stale(holder):
                    raise self._refuse(holder)
                self.storage.remove(self.url)  # left by a dead run: take it over
                holder = None
            if holder is not None:  # ours (another Accelerator of this process): refresh it
                self.storage.write_bytes(self.url, self._payload(), atomic=True)
                return
            if not self.storage.create_exclusive(self.url, self._payload()):
                continue  # somebody created it in between: look again
            written = self._read()  # where creation is not exclusive, the last writer wins
            if written is not None and written.get("token") == self.token:
                return
        holder = self._read() or {}
        raise self._refuse(holder)

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        with contextlib.suppress(Exception):
            holder = self._read()
            if holder is not None and self._ours(holder):
                self.storage.remove(self.url)
