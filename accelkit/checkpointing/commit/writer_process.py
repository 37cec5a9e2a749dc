"""The writer process of asynchronous saves: hashing and file writes out of the training
interpreter.

An asynchronous save copies the state into host buffers and writes it in the background (see
:mod:`~accelkit.checkpointing.commit.async_save`). Written by a thread of the training process,
the hashing, the file writes and their Python bookkeeping hold the GIL and slow the training
step down. With the *process writer*, the host buffers live in shared memory
(:class:`SharedArena`: anonymous ``memfd`` segments, never a name under ``/dev/shm``), and a
persistent child process (:class:`WriterProcess`, started at the first asynchronous save that
can use it) reads them in place and writes the files: the same function, the same formats, the
same checksums as a synchronous save (:meth:`~accelkit.checkpointing.commit.snapshot.
FrozenSnapshot.write`). The training process keeps the rest of the commit sequence (agreeing
with the other processes, the manifest, retention, the save lock, tracker events): small
files and a few messages, in a thread that waits for the writer with the GIL released.

The writer runs at a lower CPU priority (``nice`` +:data:`NICENESS`) and, where the kernel
allows, the lowest best-effort I/O priority (``ioprio_set``); a refusal (``EPERM``) is ignored.
It runs in a session of its own and ignores ``SIGINT``: Ctrl-C in the terminal reaches the
training process only, which decides (interpreter exit waits for the save in flight, as with the
thread writer). It ignores ``SIGXFSZ`` (a file-size limit fails the write instead of killing
the writer), and exits as soon as its parent is gone (end of its command pipe, or its parent
process id changing), so it never outlives training.

A writer that dies (killed, out of memory) fails the save it was writing: that checkpoint is
not committed (an automatically named folder is removed) and the next save starts a new writer.

Public API: :class:`SharedArena`, :class:`WriterProcess`, :class:`ProcessPayload`,
:class:`WriterProcessDied`, :func:`process_writer_available`, :func:`shared_writer`,
:func:`close_writers`,
:data:`NICENESS`, :data:`CHUNK_BYTES`.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.storage import Storage, WrittenFile
from accelkit.runtime.preemption import signal_name

__all__ = [
    "CHUNK_BYTES",
    "NICENESS",
    "ProcessPayload",
    "SharedArena",
    "WriterProcess",
    "WriterProcessDied",
    "close_writers",
    "shared_writer",
    "process_writer_available",
]

logger = logging.getLogger(__name__)

NICENESS = 10
"""How much the writer process lowers its CPU priority (``os.nice``)."""

CHUNK_BYTES = 64 * 1024 * 1024
"""The smallest shared-memory segment :class:`SharedArena` creates (bigger buffers get one of
their own size) once the arena holds that much; the first ones are smaller."""

_FIRST_CHUNK = 1024 * 1024

# The text every process's error carries when a writer died: how the driver tells such a
# failure (reported as a warning) from a failed write (raised).
CRASH_MARK = "the background writer process died"

_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_WHO_PROCESS = 2, 13, 1
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}


class WriterProcessDied(CheckpointError):
    """The writer process died while it wrote a checkpoint (that checkpoint is not committed;
    the next save starts a new writer)."""


def process_writer_available() -> tuple[bool, str]:
    """Whether this platform can run the process writer, and why not.

    It needs Linux (``memfd_create`` and passing file descriptors over a Unix socket).
    """
    if not sys.platform.startswith("linux"):
        return False, f"the process writer needs Linux (this is {sys.platform})"
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return False, "this Python has no os.memfd_create or socket.send_fds"
    return True, ""


# ---------------------------------------------------------------------- shared memory


@dataclass
class _Segment:
    fd: int
    size: int
    memory: mmap.mmap
    base: torch.Tensor  # uint8 over the whole segment
    registered: bool = False  # cudaHostRegister-ed
    unregister: weakref.finalize | None = None  # undoes the registration, once


_ARENA_IDS = itertools.count()
_SEGMENT_IDS = itertools.count()


class SharedArena:
    """Host buffers in shared memory: anonymous ``memfd`` segments of at least
    :data:`CHUNK_BYTES`, each holding one or more buffers (a few file descriptors, not one per
    tensor: a model with thousands of tensors stays far below the process's open-file limit).

    The segments have no name (nothing appears under ``/dev/shm``, so nothing can be left
    there) and are freed when the last process holding them lets go: the training process
    (:meth:`keep_only`, :meth:`release`) and the writer process. Their memory is reserved when
    they are created (``posix_fallocate``), so a machine without the room fails there, with an
    ``OSError``, and never later with a ``SIGBUS`` in the middle of a copy. Buffers start on
    a page boundary.
    """

    def __init__(self) -> None:
        self._segments: dict[int, _Segment] = {}  # by the base address of its mapping
        self._ids: dict[int, int] = {}  # base address -> segment id (unique in this process)
        self.id = next(_ARENA_IDS)
        """This arena's number (unique in this process), as the writer knows it."""
        self._free: dict[bool, tuple[int, int]] = {}  # pinned? -> (segment base, next offset)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory held."""
        return sum(s.size for s in self._segments.values())

    def empty(self, shape: torch.Size, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """A new tensor of ``shape`` and ``dtype`` in shared memory; ``pin`` places it in a
        segment registered with CUDA (page-locked, for asynchronous device-to-host copies).

        Raises:
            OSError: the memory cannot be reserved (``ENOMEM``/``ENOSPC``, ``EMFILE``).
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = int(torch.Size(shape).numel())
        nbytes = max(1, numel * itemsize)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            where = self._free.get(pin)
            segment = None if where is None else self._segments.get(where[0])
            if segment is None or where is None or where[1] + size > segment.size:
                # Geometric growth: small states reserve little, big ones use few segments.
                grow = min(CHUNK_BYTES, max(_FIRST_CHUNK, self.nbytes))
                segment = self._new_segment(max(size, grow), pin)
                where = (segment.base.data_ptr(), 0)
            offset = where[1]
            self._free[pin] = (where[0], offset + size)
        view = segment.base[offset : offset + nbytes - nbytes % itemsize].view(dtype)
        return view[:numel].view(shape)

    def _new_segment(self, size: int, pin: bool) -> _Segment:
        fd = os.memfd_create("accelkit-snapshot", getattr(os, "MFD_CLOEXEC", 1))
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        base = torch.frombuffer(memory, dtype=torch.uint8)
        segment = _Segment(fd, size, memory, base)
        if pin:
            error = _cuda_register(base)
            if error is not None:
                # Never used, pinned or not: a range CUDA already holds (error 712, a mapping
                # someone unmapped while registered) would have the device copy into the pages
                # of the old mapping, not these. The caller falls back to ordinary pinned memory.
                del base, segment
                try:
                    memory.close()
                except BufferError:  # pragma: no cover - a view still alive: freed with it
                    pass
                os.close(fd)
                raise OSError(f"cudaHostRegister of {size} bytes failed: {error}")
            segment.registered = True
            # Unregistered when the segment is released, or at the latest when its base view is
            # collected: always before the mapping can be unmapped (the view holds it), so that
            # no registration outlives its pages and a later mapping at the same address is
            # never mistaken for pinned.
            segment.unregister = weakref.finalize(base, _cuda_unregister, base.data_ptr())
        self._segments[base.data_ptr()] = segment
        self._ids[base.data_ptr()] = next(_SEGMENT_IDS)
        return segment

    def locate(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(segment id, byte offset)`` of ``tensor``'s storage, or ``None`` outside the
        arena."""
        base = tensor.untyped_storage().data_ptr()
        segment = self._ids.get(base)
        if segment is None:
            return None
        return segment, tensor.data_ptr() - base

    def segments(self) -> dict[int, tuple[int, int]]:
        """Segment id -> ``(fd, size)`` of every segment held."""
        return {self._ids[b]: (s.fd, s.size) for b, s in self._segments.items()}

    def keep_only(self, tensors: list[torch.Tensor]) -> None:
        """Release every segment none of ``tensors`` lives in (the buffers a snapshot gave
        back)."""
        used = {t.untyped_storage().data_ptr() for t in tensors}
        with self._lock:
            for base in [b for b in self._segments if b not in used]:
                self._drop(base)

    def release(self) -> None:
        """Release every segment (the writer process's mappings go with its own copies)."""
        with self._lock:
            for base in list(self._segments):
                self._drop(base)

    def _drop(self, base: int) -> None:
        segment = self._segments.pop(base)
        self._ids.pop(base, None)
        self._free = {k: v for k, v in self._free.items() if v[0] != base}
        if segment.unregister is not None:
            segment.unregister()
        os.close(segment.fd)
        # The mapping itself goes when the last tensor viewing it does.


def _cuda_register(base: torch.Tensor) -> str | None:
    """Page-lock ``base`` (a whole segment) for CUDA; ``None`` on success, else the error.

    A refused registration also leaves CUDA's "last error" set, which PyTorch would report at
    the next kernel launch of the training step as that kernel's failure: it is cleared here.
    """
    if not torch.cuda.is_available():
        return "CUDA is not available"
    code = int(torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), 0))
    if code == 0:
        return None
    _clear_cuda_error()
    try:
        text = str(torch.cuda.cudart().cudaGetErrorString(code))
    except Exception:  # pragma: no cover - older bindings
        text = ""
    return f"CUDA error {code}" + (f" ({text})" if text else "")


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (``cudaGetLastError``) of the runtime PyTorch uses:
    the ``libcudart`` mapped into this process (PyTorch's wheels load it as a shared library;
    where it is linked in statically there is nothing to find and nothing is done)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            # RTLD_NOLOAD: the copy already loaded, whose state PyTorch's calls share.
            mode = getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LAZY", 1)
            ctypes.CDLL(path, mode=mode).cudaGetLastError()
    except (OSError, AttributeError, IndexError):  # pragma: no cover - best effort
        pass


def _cuda_unregister(address: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # pragma: no cover - best effort at release
        pass


# ---------------------------------------------------------------------- the job


@dataclass(frozen=True)
class _Ref:
    """A tensor in a shared segment, as the writer process rebuilds it."""

    segment: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Encoder:
    def __init__(self, arena: SharedArena) -> None:
        self.arena = arena
        self.refs: dict[int, _Ref] = {}

    def value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            where = self.arena.locate(value) if value.layout == torch.strided else None
            if where is None:
                return value  # rare (sparse, quantized, empty): pickled with its data
            return _Ref(where[0], where[1], value.dtype, tuple(value.shape), tuple(value.stride()))
        return value

    def tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self.value(v) for k, v in tensors.items()}


class _Decoder:
    def __init__(self, maps: Mapping[int, torch.Tensor]) -> None:
        self.maps = maps
        self.made: dict[_Ref, torch.Tensor] = {}

    def value(self, value: Any) -> Any:
        if not isinstance(value, _Ref):
            return value
        made = self.made.get(value)
        if made is None:  # the same ref twice (tied weights): the same tensor object
            base = self.maps[value.segment]  # a whole number of pages: any itemsize divides it
            flat = base.view(value.dtype)
            itemsize = flat.element_size()
            made = flat.as_strided(value.shape, value.stride, value.offset // itemsize)
            self.made[value] = made
        return made

    def tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self.value(v) for k, v in tensors.items()}


class ProcessPayload:
    """A :class:`~accelkit.checkpointing.commit.snapshot.FrozenSnapshot` in shared memory,
    written by a :class:`WriterProcess` (its sharded FSDP state, written by a collective of the
    training processes, stays in the calling thread).

    Args:
        frozen: the snapshot, its buffers in ``arena``.
        arena: the shared memory.
        writer: the writer process.
    """

    def __init__(self, frozen: Any, arena: SharedArena, writer: WriterProcess) -> None:
        self.frozen = frozen
        self.arena = arena
        self.writer = writer

    @property
    def has_sharded(self) -> bool:
        """Whether it holds sharded (FSDP) state."""
        return bool(self.frozen.has_sharded)

    def write_sharded(self, storage: Storage, folder: str, group: Any) -> list[Any]:
        """Write the sharded state in this thread (a DCP collective on ``group``)."""
        return list(self.frozen.write_sharded(storage, folder, group))

    def write(
        self, storage: Storage, folder: str, max_shard_size: int | str = "10GB"
    ) -> dict[str, WrittenFile]:
        """Have the writer process write the files into ``folder`` (``storage`` must be the
        local disk); blocks until they are durable.

        Raises:
            WriterProcessDied: the writer died meanwhile.
        """
        self.frozen.wait_copies()  # the device-to-host copies, before another process reads
        encoder = _Encoder(self.arena)
        job = {
            "folder": folder,
            "max_shard_size": max_shard_size,
            "models": [(stem, encoder.tensors(sd)) for stem, sd in self.frozen.models],
            "states": [
                (s.stem, s.tree, encoder.tensors(s.tensors), s.extras) for s in self.frozen.states
            ],
        }
        return self.writer.write(job, self.arena)


# ---------------------------------------------------------------------- the process


class WriterProcess:
    """One persistent writer process (started by :meth:`ensure`, replaced after it died);
    :func:`shared_writer` is the one an interpreter's savers share.

    Jobs go as pickles over a Unix socket; the shared segments' file descriptors go once
    each, over a second socket (``SCM_RIGHTS``). One job at a time: savers that share it wait
    for each other.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._fds: socket.socket | None = None
        self._sent: set[int] = set()  # segment ids the live writer has
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # one job at a time (several savers may share it)

    @property
    def pid(self) -> int | None:
        """The writer's process id (``None`` before it starts)."""
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """Whether the writer process is running."""
        return self._proc is not None and self._proc.poll() is None

    def ensure(self) -> None:
        """Start the writer process unless it runs."""
        with self._lock:
            if self.alive():
                return
            self._close_channels()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fds_ours, fds_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            root = _package_root()
            code = (
                "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                f"import sys; sys.path.insert(0, {root!r}); "
                "from accelkit.checkpointing.commit.writer_process import _main; "
                f"_main({theirs.fileno()}, {fds_theirs.fileno()}, {os.getpid()})"
            )
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", code],
                    pass_fds=(theirs.fileno(), fds_theirs.fileno()),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,  # stderr stays: its own crash reports
                    # Its own session: the terminal's Ctrl-C (sent to the foreground process
                    # group) reaches the training process only, which decides.
                    start_new_session=True,
                )
            finally:
                theirs.close()
                fds_theirs.close()
            self._conn = Connection(ours.detach())
            self._fds = fds_ours
            self._sent = set()
            _LIVE.add(self)

    def write(self, job: dict[str, Any], arena: SharedArena) -> dict[str, WrittenFile]:
        """Send ``job`` (with the segments the writer lacks) and wait for its files.

        Raises:
            WriterProcessDied: the writer died before it answered.
            Exception: the writer's failure, as it raised it.
        """
        with self._busy:
            self.ensure()
            segments = arena.segments()
            new = [i for i in segments if i not in self._sent]
            job = {
                **job,
                "arena": arena.id,
                "new": [(i, segments[i][1]) for i in new],
                "keep": sorted(segments),
            }
            reply = self._ask(job, [segments[i][0] for i in new], job["folder"])
            self._sent |= set(segments)
        if "error" in reply:
            raise _rebuild(reply)
        files: dict[str, WrittenFile] = reply["files"]
        return files

    def forget(self, arena: SharedArena) -> None:
        """Have the writer unmap ``arena``'s segments (their memory is freed once the training
        process lets go of them too)."""
        with self._busy:
            if not self.alive():
                return
            try:
                self._ask({"op": "forget", "arena": arena.id}, [], "")
            except WriterProcessDied:
                pass

    def _ask(self, job: dict[str, Any], fds: list[int], folder: str) -> dict[str, Any]:
        conn, channel = self._conn, self._fds
        assert conn is not None and channel is not None
        try:
            conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
            for start in range(0, len(fds), 200):
                socket.send_fds(channel, [b"s"], fds[start : start + 200])
            reply: dict[str, Any] = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._died(folder) from exc
        return reply

    def _died(self, folder: str) -> WriterProcessDied:
        proc, pid = self._proc, self.pid
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # alive but its socket broke: replace it
                proc.kill()
                code = proc.wait()
        self._close_channels()
        how = (
            f"killed by {signal_name(-code)}"
            if code is not None and code < 0
            else f"exit status {code}"
        )
        return WriterProcessDied(
            f"{CRASH_MARK} (pid {pid}, {how}) while writing {folder}; that checkpoint was not "
            "committed and earlier ones are untouched. A new writer process starts with the "
            "next save; if this repeats, look for the OOM killer in the system log, or pass "
            "ProjectConfiguration(async_writer='thread')."
        )

    def _close_channels(self) -> None:
        for channel in (self._conn, self._fds):
            if channel is not None:
                try:
                    channel.close()
                except OSError:
                    pass
        self._conn, self._fds = None, None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer (it exits at the end of its command pipe) and wait for it."""
        with self._lock:
            proc = self._proc
            self._close_channels()
            self._proc = None
            _LIVE.discard(self)
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _package_root() -> str:
    """The folder ``accelkit`` is imported from (put first on the writer's path)."""
    here = os.path.abspath(__file__)  # <root>/accelkit/checkpointing/commit/writer_process.py
    for _ in range(4):
        here = os.path.dirname(here)
    return here


def _rebuild(reply: Mapping[str, Any]) -> BaseException:
    """The writer's failure as an exception of this process."""
    error = reply.get("error")
    if isinstance(error, BaseException):
        return error
    return CheckpointError(str(reply.get("text", "the writer process failed")))


_LIVE: set[WriterProcess] = set()
_SHARED: list[WriterProcess] = []
_SHARED_LOCK = threading.Lock()


def shared_writer() -> WriterProcess:
    """This interpreter's writer process (not started yet: :meth:`WriterProcess.ensure`),
    shared by every asynchronous saver of it."""
    with _SHARED_LOCK:
        if not _SHARED:
            _SHARED.append(WriterProcess())
        return _SHARED[0]


def close_writers() -> None:
    """Stop every writer process of this interpreter (at its exit)."""
    for writer in list(_LIVE):
        writer.close()


# ---------------------------------------------------------------------- in the writer


def _lower_priority() -> None:
    """``nice`` +:data:`NICENESS` and the lowest best-effort I/O priority (where allowed)."""
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    number = _SYS_IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7
        libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, value)  # EPERM etc. ignored
    except Exception:  # pragma: no cover - no libc to call
        pass


def _watch_parent(parent: int) -> None:
    """Exit as soon as the parent is gone, even in the middle of a write."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.2)


def _main(conn_fd: int, fds_fd: int, parent: int) -> None:  # pragma: no cover - child process
    """The writer process's loop: read a job, write its files, answer; exit at end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit fails the write: EFBIG
    _lower_priority()
    torch.set_num_threads(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from accelkit.checkpointing.commit.snapshot import FrozenSnapshot, _EncodedState
    from accelkit.checkpointing.storage import get_storage, sync_batch

    conn = Connection(conn_fd)
    fds = socket.socket(fileno=fds_fd)
    arenas: dict[int, dict[int, torch.Tensor]] = {}
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        if job.get("op") == "forget":
            arenas.pop(job["arena"], None)
            conn.send_bytes(pickle.dumps({"files": {}}))
            continue
        maps = arenas.setdefault(job["arena"], {})
        new = list(job["new"])
        while new:
            count = min(200, len(new))
            _, received, _, _ = socket.recv_fds(fds, 16, count)
            for (segment, size), fd in zip(new[:count], received):
                memory = mmap.mmap(fd, size)
                os.close(fd)
                maps[segment] = torch.frombuffer(memory, dtype=torch.uint8)
            new = new[count:]
        for segment in [s for s in maps if s not in set(job["keep"])]:
            del maps[segment]
        try:
            decoder = _Decoder(maps)
            frozen = FrozenSnapshot(
                models=[(stem, decoder.tensors(sd)) for stem, sd in job["models"]],
                states=[
                    _EncodedState(stem, tree, decoder.tensors(tensors), extras)
                    for stem, tree, tensors, extras in job["states"]
                ],
            )
            storage = get_storage(job["folder"])
            with sync_batch():
                files = frozen.write(storage, job["folder"], job["max_shard_size"])
            del frozen, decoder
            reply: dict[str, Any] = {"files": files}
        except Exception as exc:
            reply = {"error": exc, "text": f"{type(exc).__name__}: {exc}"}
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = pickle.dumps({"error": None, "text": reply.get("text")})
        try:
            conn.send_bytes(data)
        except OSError:
            os._exit(0)
