"""Peer copies: each process's newest snapshot also kept by another process, so that a lost
machine (or a lost snapshot folder) loses no state.

The processes form a ring with a stride of one machine (``LOCAL_WORLD_SIZE``; 1 on a single
machine): process ``r`` sends each committed snapshot to :func:`holder` ``(r + stride) % world``
and keeps the copy of ``(r - stride) % world``'s, under ``<job memory>/copies/rank_<src>/``. A
background thread (:class:`PeerCopies`) does it after each snapshot commits, over a gloo group
of its own, so the step never waits for it; a snapshot that failed is sent as "nothing", so
the two sides stay in step.

At a restore (:func:`fetch_missing`), a process whose own snapshot of the agreed step is gone
gets it back from its holder, written into its own folder, then loaded and verified like any
snapshot (the manifest's checksums cover what travelled).

What travels is a list of relative file names and sizes (JSON) and the bytes, checked before
anything is written: names stay inside the folder (no ``..``, no absolute path, no link
followed when writing), sizes add up.

Public API: :class:`PeerCopies`, :func:`holder`, :func:`held_source`, :func:`fetch_missing`,
:data:`COPIES`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from typing import Any

import torch

from accelkit._text import clip, short
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage.base import StorageError

__all__ = ["COPIES", "PeerCopies", "fetch_missing", "held_source", "holder"]

logger = logging.getLogger("accelkit.checkpointing.memory")

#: The folder, in the job's shared memory, of the copies a process keeps for its peer.
COPIES = "copies"
_MAX_HEADER = 1 << 20  # a snapshot's file list is a few hundred bytes per file


def _stride(world: int, local: int) -> int:
    return local if 0 < local < world and world % local == 0 else 1


def holder(rank: int, world: int, local: int) -> int:
    """The process that keeps ``rank``'s copy: one machine further along the ring."""
    return (rank + _stride(world, local)) % world


def held_source(rank: int, world: int, local: int) -> int:
    """The process whose copy ``rank`` keeps."""
    return (rank - _stride(world, local)) % world


def pack(folder: str) -> tuple[int, bytearray]:
    """``folder`` as one buffer: a header (its files' relative names and sizes, JSON) and their
    bytes; returns the header's length and the buffer."""
    names: list[list[Any]] = []
    paths: list[str] = []
    for root, _dirs, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            names.append([os.path.relpath(path, folder), os.path.getsize(path)])
            paths.append(path)
    header = json.dumps(names).encode()
    payload = bytearray(len(header) + sum(size for _, size in names))
    payload[: len(header)] = header
    view, offset = memoryview(payload), len(header)
    for path, (_, size) in zip(paths, names):
        with open(path, "rb") as f:
            if f.readinto(view[offset : offset + size]) != size:
                raise StorageError(f"{path} changed while it was read")
        offset += size
    return len(header), payload


def unpack(header_len: int, payload: memoryview, folder: str) -> None:
    """Write what :func:`pack` made into a new ``folder`` (through ``<folder>.partial``).

    Raises:
        CorruptCheckpointError: a name leaves the folder, or the sizes do not add up; nothing
            is left behind then.
    """
    body = payload[header_len:]
    try:
        entries = json.loads(bytes(payload[:header_len]))
        pairs = (
            [(str(name), int(size)) for name, size in entries]
            if isinstance(entries, list)
            else None
        )
    except (ValueError, TypeError) as exc:
        pairs, entries = None, exc
    if pairs is None:
        raise CorruptCheckpointError(f"A peer copy's file list is malformed ({short(entries)}).")
    checked = [(_safe_name(name), size) for name, size in pairs]
    total = sum(size for _, size in checked)
    if total != len(body) or any(size < 0 for _, size in checked):
        raise CorruptCheckpointError(
            f"A peer copy's sizes add up to {total} bytes, but {len(body)} came."
        )
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        offset = 0
        for name, size in checked:
            path = os.path.join(partial, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            with os.fdopen(os.open(path, flags, 0o600), "wb") as f:
                f.write(body[offset : offset + size])
            offset += size
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _safe_name(name: str) -> str:
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpointError(f"A peer copy's file name {short(name)} leaves the folder.")
    return os.path.join(*parts)


def _exchange(
    out: tuple[int, bytearray] | None, to: int | None, frm: int | None, group: Any = None
) -> tuple[int, memoryview] | None:
    """Send ``out`` (a header length and a buffer; ``(0, empty)``: nothing) to ``to`` while
    receiving one from ``frm`` (either may be ``None``), on ``group`` (gloo). The sizes travel
    first, always, so a side that has nothing to send never leaves the other waiting.

    Returns:
        What came from ``frm`` (``None`` without one).

    Raises:
        CorruptCheckpointError: the announced sizes are impossible.
    """
    import torch.distributed as dist

    works: list[Any] = []
    if to is not None and out is not None:
        header_len, payload = out
        sizes = torch.tensor([header_len, len(payload)], dtype=torch.int64)
        works.append(dist.isend(sizes, to, group=group))
        if payload:
            works.append(dist.isend(torch.frombuffer(payload, dtype=torch.uint8), to, group=group))
    result = None
    if frm is not None:
        theirs = torch.empty(2, dtype=torch.int64)
        dist.recv(theirs, frm, group=group)
        header_len, total = int(theirs[0]), int(theirs[1])
        if not 0 <= header_len <= min(total, _MAX_HEADER):
            raise CorruptCheckpointError(
                f"Process {frm} announced a copy of {total} bytes with a {header_len}-byte list."
            )
        received = torch.empty(total, dtype=torch.uint8)
        if total:
            dist.recv(received, frm, group=group)
        result = header_len, received.numpy().data.cast("B")
    for work in works:
        work.wait()
    return result


class PeerCopies:
    """The background thread that sends each committed snapshot to its holder and keeps the
    copy it receives (see the module docstring).

    Args:
        root: the job's shared-memory folder.
        rank: this process.
        world: the number of processes.
        local: processes per machine.
        group: the gloo group of the copies (every process's own, created alike).
    """

    def __init__(self, root: str, rank: int, world: int, local: int, group: Any) -> None:
        self.root = root
        self.to = holder(rank, world, local)
        self.frm = held_source(rank, world, local)
        self.group = group
        self.copies = os.path.join(root, COPIES, f"rank_{self.frm}")
        self.sent = 0
        self._queue: queue.Queue[tuple[Callable[[], str | None], int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="accelkit-peer-copies", daemon=True)
        self._thread.start()

    def submit(self, committed: Callable[[], str | None], step: int) -> None:
        """Send the snapshot of ``step`` once ``committed()`` returns its folder (``None``: it
        failed; "nothing" is sent)."""
        self._queue.put((committed, step))

    def close(self, timeout: float = 60.0) -> None:
        """Finish the copies queued (up to ``timeout`` seconds) and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            committed, step = item
            out = self._packed(committed(), step)
            try:
                got = _exchange(out, self.to, self.frm, self.group)
            except Exception as exc:  # the ring is broken: no more copies this run
                logger.warning(
                    "Peer copies of memory snapshots stopped at step %d (%s: %s); a lost "
                    "machine now resumes from the disk.",
                    step,
                    type(exc).__name__,
                    clip(str(exc), 1000),
                )
                return
            self.sent += 1
            if got is None or not got[0]:  # "nothing": the peer's snapshot failed
                continue
            try:  # a copy that cannot be kept is this process's loss; the ring goes on
                unpack(*got, os.path.join(self.copies, f"snapshot_{step}"))
                self._prune(keep=f"snapshot_{step}")
            except (OSError, CorruptCheckpointError) as exc:
                logger.warning(
                    "Cannot keep process %d's snapshot of step %d: %s", self.frm, step, exc
                )

    @staticmethod
    def _packed(folder: str | None, step: int) -> tuple[int, bytearray]:
        """The snapshot to send; "nothing" when it failed or cannot be read (a newer one
        replaced it already), so the peer is never left waiting."""
        if folder is not None:
            try:
                return pack(folder)
            except OSError as exc:
                logger.warning("Not copying the snapshot of step %d to its peer: %s", step, exc)
        return 0, bytearray()

    def _prune(self, keep: str) -> None:
        for name in os.listdir(self.copies):
            if name != keep:
                shutil.rmtree(os.path.join(self.copies, name), ignore_errors=True)


def fetch_missing(
    root: str, rank: int, world: int, local: int, step: int, have: list[bool], mine: str
) -> None:
    """At a restore, on every process, on the default process group: the holders of the
    processes without their own snapshot of ``step`` (``have[q]`` False) send their copies,
    which those processes write to ``mine`` (their own folder for ``step``). A holder that
    cannot read its copy sends nothing, and the process waiting for it raises.

    Raises:
        CorruptCheckpointError: no copy came, or it could not be written.
    """
    src, dst = held_source(rank, world, local), holder(rank, world, local)
    out: tuple[int, bytearray] | None = None
    if not have[src]:  # this process keeps src's copy: send it back
        try:
            out = pack(os.path.join(root, COPIES, f"rank_{src}", f"snapshot_{step}"))
        except OSError as exc:
            logger.warning("Cannot send process %d its snapshot of step %d: %s", src, step, exc)
            out = (0, bytearray())
    got = _exchange(out, src if out is not None else None, None if have[rank] else dst)
    if got is None:
        return
    if not got[0]:
        raise CorruptCheckpointError(
            f"Process {dst} could not send its copy of process {rank}'s snapshot of step {step}."
        )
    unpack(*got, mine)
