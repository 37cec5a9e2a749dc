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

``accelkit ckpt prune`` takes the same lock while it deletes (role ``prune``, recorded in the
file): a prune that finds a live save holding it is refused, and a save that finds a live prune
holding it waits for it (up to :data:`PRUNE_WAIT_S` seconds; a prune takes seconds).

``accelkit ckpt import`` is a save too (role ``import``): it holds the lock while it picks its
``checkpoint_<n>``, writes and commits it. An import waits for a save, a prune or another import
in flight, and a save waits for an import (each up to :data:`PRUNE_WAIT_S`): importing beside a
running job is the documented way to move over from Accelerate, so neither side is refused, and
a save whose next number an import took moves past it
(:mod:`~accelkit.checkpointing.commit.protocol`).

A folder is claimed with :func:`claim_folder`: created exclusively (``mkdir`` on a local disk,
the save marker as a conditional PUT on object stores), so that nothing ever writes into a
folder it did not create, whatever took the name between a look and the creation.

Public API: :data:`LOCK_NAME`, :data:`STALE_AFTER_S`, :data:`PRUNE_WAIT_S`, :data:`SAVE`,
:data:`PRUNE`, :data:`IMPORT`, :class:`RunLock` (``acquire()``, ``release()``),
:func:`claim_folder`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from accelkit._env import number
from accelkit._text import short
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.base import StorageExistsError
from accelkit.errors import ConfigurationError

__all__ = [
    "IMPORT",
    "LOCK_NAME",
    "PRUNE",
    "PRUNE_WAIT_S",
    "SAVE",
    "STALE_AFTER_S",
    "RunLock",
    "claim_folder",
]

LOCK_NAME = ".accelkit-run.lock"
STALE_AFTER_S = number("ACCELKIT_LOCK_STALE_S")
PRUNE_WAIT_S = 300.0
SAVE = "save"
PRUNE = "prune"
IMPORT = "import"
_ROLES = (SAVE, PRUNE, IMPORT)
_POLL_S = 0.05

logger = logging.getLogger(__name__)


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
        role: :data:`SAVE` (a run saving checkpoints), :data:`PRUNE` (``ckpt prune``) or
            :data:`IMPORT` (``ckpt import``).
    """

    def __init__(self, storage: Storage, project_dir: str, role: str = SAVE) -> None:
        if role not in _ROLES:
            raise ConfigurationError(
                f"role must be one of {', '.join(map(repr, _ROLES))}, got {role!r}."
            )
        self.storage = storage
        self.role = role
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
            "role": self.role,
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

    def _waits_for(self, holder: dict[str, Any]) -> bool:
        # Each of these holds the lock for one operation of seconds; waiting is what the user
        # wants. Two training runs (save vs save) and a prune meeting a save are refused.
        other = holder.get("role")
        if self.role == IMPORT:
            return True
        return self.role == SAVE and other in (PRUNE, IMPORT)

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
        who = f"pid {holder.get('pid')} on host {holder.get('host')!r}"
        if self.role == IMPORT:
            return CheckpointError(
                f"{self.root} is in use ({who} holds its save lock as {holder.get('role')!r} "
                f"since {when}, longer than {PRUNE_WAIT_S:.0f} s): nothing was imported. Try "
                "again once it has finished; if that process is gone (e.g. it ran on another "
                f"machine), delete {self.url}."
            )
        if self.role == SAVE and holder.get("role") == IMPORT:
            return CheckpointError(
                f"{self.root} has an `accelkit ckpt import` in flight ({who} imports there since "
                f"{when}, longer than {PRUNE_WAIT_S:.0f} s). Wait for it to finish and save "
                f"again; if it is gone (e.g. it ran on another machine), delete {self.url}."
            )
        if holder.get("role") == PRUNE:
            return CheckpointError(
                f"{self.root} is being pruned ({who} runs `accelkit ckpt prune` there since "
                f"{when}). Wait for it to finish and try again; if it is gone (e.g. it ran on "
                f"another machine), delete {self.url}."
            )
        if self.role == PRUNE:
            return CheckpointError(
                f"{self.root} has a checkpoint save in flight ({who} is saving there since "
                f"{when}); prune deletes nothing while a run saves into the project. Run it "
                f"again once the save has finished; if that run is gone (e.g. it ran on another "
                f"machine), delete {self.url} and prune again."
            )
        return CheckpointError(
            f"{self.root} is in use by another run (pid {holder.get('pid')} on host "
            f"{holder.get('host')!r} is saving a checkpoint there since {when}): two runs "
            "saving automatic checkpoints into one project_dir would overwrite each other's "
            "checkpoints. Give this run its own project_dir; if that run is gone (e.g. it ran "
            f"on another machine), delete {self.url} and save again."
        )

    def acquire(self) -> None:
        """Take the lock before a save (or a prune).

        A save that finds a live prune or import holding it waits for it, and an import waits
        for any live holder, up to :data:`PRUNE_WAIT_S`.

        Raises:
            CheckpointError: another live run holds it (naming its host and pid, and the fix).
        """
        self.storage.makedirs(self.root)
        deadline = time.monotonic() + PRUNE_WAIT_S
        tries = 0
        told = False
        while tries < 3:
            tries += 1
            holder = self._read()
            if holder is not None and not self._ours(holder):
                if not self._stale(holder):
                    if self._waits_for(holder) and time.monotonic() < deadline:
                        if not told:  # a silent wait of minutes looks like a hang
                            told = True
                            logger.warning(
                                "%s: waiting for pid %s on host %s (%s) to release its save "
                                "lock, up to %.0f s",
                                self.root,
                                short(holder.get("pid")),
                                short(holder.get("host")),
                                short(holder.get("role")),
                                PRUNE_WAIT_S,
                            )
                        time.sleep(_POLL_S)  # a prune takes seconds: the save goes on after it
                        tries -= 1
                        continue
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


def claim_folder(storage: Storage, url: str, marker_name: str, marker: bytes) -> None:
    """Create the folder ``url`` holding the file ``marker_name`` (``marker``), only if
    nothing is at ``url`` yet.

    On a local disk the folder itself is created with ``mkdir`` (atomic: of two creators, one
    fails), so an existing folder, file or symbolic link is never written into; on an object
    store, where folders are implicit, the marker is created with a conditional PUT and an
    existing prefix is refused first.

    Args:
        storage: the storage of ``url``.
        url: the new folder (path or URL).
        marker_name: the first file written into it (the save marker).
        marker: its content.

    Raises:
        FileExistsError: something is at ``url`` already; nothing was written.
    """
    target = url.rstrip("/") or url
    local = storage.local_path(target)
    if local is not None:
        parent = os.path.dirname(local)
        if parent:
            os.makedirs(parent, exist_ok=True)
        os.mkdir(local)  # FileExistsError for a folder, a file or a link already there
    elif storage.exists(target):
        raise StorageExistsError(errno.EEXIST, f"{target} already exists", target)
    else:
        storage.makedirs(target)  # a no-op on object stores; the marker below is the claim
    try:
        created = storage.create_exclusive(join(target, marker_name), marker)
    except BaseException:
        if local is not None:
            # An empty folder without the marker would look foreign: kept forever, its name
            # blocked. It is ours (the mkdir above) and still empty, so it goes.
            with contextlib.suppress(OSError):
                os.rmdir(local)
        raise
    if not created:
        raise StorageExistsError(
            errno.EEXIST, f"{target} is being written by another process", target
        )
