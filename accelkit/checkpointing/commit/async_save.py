"""Asynchronous saves: a driver around the one commit sequence.

``save_state(async_save=True)`` runs the sequence of :mod:`~accelkit.checkpointing.commit.protocol`
(as Lightning's ``AsyncCheckpointIO`` wraps a checkpoint IO, and torchtitan's ``AsyncMode``
switches one save function) with two differences only: *what* is written is a host copy, and
*where* the processes meet is a gloo process group of the writer's own. On every process:

1. the caller waits for the previous save (at most one is in flight) and raises its failure;
2. it runs the prepare phase, exactly as a synchronous save (the main process takes the
   project's save lock for an automatic checkpoint, checks and un-commits the folder; all
   processes agree on the outcome);
3. it runs the save pre-hooks and copies this process's share of the state into the reusable
   host buffers of a :class:`~accelkit.checkpointing.commit.snapshot.HostSnapshot` (sharded FSDP
   state too: each process its own shards, their DTensor layout kept);
4. it starts a writer thread and returns an :class:`AsyncCheckpoint` handle; the writer runs
   the rest of the sequence (agree on the capture, write, exchange, commit, retention, release,
   done) on the separate gloo group, created once at the first asynchronous save, so the
   writer's messages and DCP's collective never interleave with the training loop's
   collectives on the default group.

**Which writer** (``ProjectConfiguration.async_writer``): with ``"process"`` or ``"auto"`` (the
default), the host buffers are shared memory and the files are hashed and written by a
persistent writer process at a lower CPU and I/O priority
(:mod:`~accelkit.checkpointing.commit.writer_process`), so that work no longer competes with the
training step for the GIL; the writer thread then only waits for it and runs the small rest of
the sequence. The thread writes the files itself (as before) where a process cannot: with
``"thread"``, on a platform other than Linux, for storage other than the local disk (an object
store's clients and credentials live in the training process), once shared memory for the
snapshot could not be reserved, and, under ``"auto"``, for state on a GPU (its snapshot goes to
PyTorch's page-locked memory; see docs/guides/async-writer.md). ``"process"`` warns (once per
cause) when it falls back to the thread; ``"auto"`` says so at debug level. Both writers leave
the same files, manifest and checksums, as they run the same function.

**How the state is copied** (``ProjectConfiguration.async_snapshot``): with ``"blocking"`` (the
default) step 3 copies every tensor before ``save_state`` returns. With ``"overlapped"`` the
large CPU parameters and state tensors of the prepared optimizers (``guard``) are copied by a
background thread (:class:`~accelkit.checkpointing.commit.snapshot.DeferredCopy`) while the
caller runs the next forward and backward; everything else is copied at once. The fence: the
prepared optimizers' ``step()`` (through ``AcceleratedOptimizer.before_step``, set while the copy
runs and cleared by it), :meth:`AsyncSaver.wait` (hence the next save, ``load_state``,
``wait_for_checkpoints``, ``end_training``) and :meth:`AsyncSaver.wait_for_snapshot` (LocalSGD's
averaging, ``free_memory``, users) wait for the copy first. The writer waits for it, and for
its check, before hashing: a guarded tensor changed by any path (``.data`` and ``numpy()``
writes included) before its copy fails the save, as its bytes no longer match the checksum
taken in ``save_state``.

A failure is never silent: the writer logs it when it happens, and it is raised to the caller
once: by the handle (``result()`` raises it, ``exception()`` returns it) if the caller asks,
otherwise by the next ``save_state``, ``load_state``, ``wait_for_checkpoints`` or
``end_training``. A failure while copying the state (a save pre-hook raising, say) is reported
the same way, so that every process learns of it. A failed save is not committed and earlier
checkpoints are untouched (an automatically named folder is removed).

A writer process that dies (killed, out of memory) fails its save the same way (not committed,
an automatic folder removed) but never stops training: the next ``save_state`` (or wait)
reports it once as a warning instead of raising it, and starts a new writer process.

Interpreter exit with a save in flight waits for it to commit, then stops the writer process.
A process killed meanwhile leaves a folder without ``accelkit.json``, which loading and
retention ignore by design (its writer process exits with it).

Public API: :class:`AsyncCheckpoint` (the handle), :class:`AsyncSaver` (the driver),
:data:`WRITER_MODES`.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from accelkit.checkpointing.commit.payload import LivePayload, Payload
from accelkit.checkpointing.commit.protocol import GroupCoordinator, ProcessIdentity, SaveSequence
from accelkit.checkpointing.commit.snapshot import DeferredCopy, HostSnapshot
from accelkit.checkpointing.commit.writer_process import (
    CRASH_MARK,
    ProcessPayload,
    SharedArena,
    WriterProcess,
    close_writers,
    process_writer_available,
    shared_writer,
)
from accelkit.checkpointing.storage import LocalStorage, Storage
from accelkit.delivery.exit import SAVES, at_exit
from accelkit.errors import ConfigurationError
from accelkit.training.optim import AcceleratedOptimizer

__all__ = ["SNAPSHOT_MODES", "WRITER_MODES", "AsyncCheckpoint", "AsyncSaver", "guarded_storages"]

WRITER_MODES = ("auto", "process", "thread")
"""The values of ``ProjectConfiguration.async_writer``: who writes an asynchronous save's
files (see the module docstring)."""

SNAPSHOT_MODES = ("blocking", "overlapped")
"""The values of ``ProjectConfiguration.async_snapshot``: whether the large tensors of the
prepared optimizers are copied before ``save_state`` returns or during the next step (see the
module docstring)."""

logger = logging.getLogger(__name__)

_CUDA_REASON = (
    "the state is on a CUDA device (async_writer='auto' leaves a GPU's snapshot in the page-"
    "locked memory of the training process; async_writer='process' asks for the writer process)"
)


class AsyncCheckpoint:
    """The handle ``save_state(async_save=True)`` returns: one save being written.

    Attributes:
        path: the checkpoint's path or URL (known at the call; committed only once done).

    Example:
        >>> handle = accelerator.save_state(async_save=True)
        >>> ...  # keep training
        >>> handle.result()  # blocks until committed; raises if the save failed
        '/runs/exp1/checkpoints/checkpoint_3'
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._seen = False  # the failure reached the caller through this handle

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"AsyncCheckpoint(path={self.path!r}, {state})"

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._finished.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save and return its failure, or ``None`` if it committed.

        Raises:
            TimeoutError: if it is still running after ``timeout`` seconds.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"The save of {self.path} is still running after {timeout} s.")
        self._seen = True
        return self._error

    def result(self, timeout: float | None = None) -> str:
        """Wait until the checkpoint is committed and return its path or URL.

        Raises:
            CheckpointError: the save failed (it was not committed).
            TimeoutError: if it is still running after ``timeout`` seconds.
        """
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self.path

    def claim(self) -> None:
        """Take this save's failure: the next save, load or wait does not raise it (read it
        with :meth:`exception`). The memory tier's snapshots are claimed: a failed snapshot
        must not fail the script's next ``save_state``."""
        self._seen = True

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()


class AsyncSaver:
    """The asynchronous driver of :class:`~accelkit.checkpointing.commit.protocol.SaveSequence`:
    capture into host buffers, run the rest of the sequence in a writer thread, hand out a
    handle. At most one save is in flight.

    Args:
        snapshot: the host buffers to copy into; a new :class:`~accelkit.checkpointing.
            snapshot.HostSnapshot` by default. It holds one host copy of the saved tensors
            between saves.
    """

    def __init__(
        self,
        snapshot: HostSnapshot | None = None,
        writer: str = "auto",
        snapshot_mode: str = "blocking",
    ) -> None:
        if writer not in WRITER_MODES:
            raise ConfigurationError(f"writer must be one of {WRITER_MODES}, got {writer!r}.")
        if snapshot_mode not in SNAPSHOT_MODES:
            raise ConfigurationError(
                f"snapshot_mode must be one of {SNAPSHOT_MODES}, got {snapshot_mode!r}."
            )
        self.snapshot = snapshot or HostSnapshot()
        self.writer = writer
        self.snapshot_mode = snapshot_mode
        """``"blocking"`` or ``"overlapped"`` (see the module docstring)."""
        self._deferred: DeferredCopy | None = None
        self.last_writer: str | None = None
        """Who wrote the newest save's files: ``"process"`` or ``"thread"``."""
        self.process: WriterProcess | None = None
        """The writer process, once started."""
        self._arena: SharedArena | None = None
        self._shared_failed = False
        self._cuda_state = False  # "auto" met CUDA tensors: the thread writes (see _allocate)
        self._warned: set[str] = set()
        self._pending: AsyncCheckpoint | None = None
        self._thread: threading.Thread | None = None
        self._group: Any = None

    @property
    def pending(self) -> AsyncCheckpoint | None:
        """The handle of the save not yet waited for by :meth:`wait`, if any."""
        return self._pending

    def idle(self) -> bool:
        """No save in flight, and no failure its caller has not been told of: a save started
        now neither waits nor raises an earlier save's failure."""
        handle = self._pending
        if handle is None:
            return True
        return handle.done() and (handle._error is None or handle._seen)

    def wait(self) -> None:
        """Block until the save in flight has finished; raise its failure unless the caller
        already got it from the handle.

        Raises:
            CheckpointError: the save failed; it was not committed.
        """
        self.wait_for_snapshot()  # even if the writer failed before waiting for it
        handle, thread = self._pending, self._thread
        if handle is None:
            return
        if thread is not None:
            thread.join()
        self._pending, self._thread = None, None
        error = handle._error
        if error is not None and not handle._seen:
            if CRASH_MARK in str(error.args[0] if error.args else error):
                handle._seen = True
                logger.warning("%s Training goes on.", error)
                return
            raise error

    def wait_for_snapshot(self) -> None:
        """Block until the background copy of an overlapped capture (if any) has finished,
        so the tensors it copies may change. Never raises: a tensor changed too early fails
        the save, which the writer reports."""
        deferred = self._deferred
        if deferred is not None:
            deferred.wait()
            self._deferred = None

    def coordinator(self, state: ProcessIdentity) -> GroupCoordinator:
        """The writer's coordinator: a gloo group of its own, created at the first
        asynchronous save (every process reaches it there, in the same order relative to any
        other group). Even on one process: the writer must not run a collective (DCP's) on the
        group the training loop uses."""
        if dist.is_available() and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return GroupCoordinator(self._group, state.process_index, state.num_processes)

    def start(
        self,
        sequence: SaveSequence,
        take: Callable[[], LivePayload],
        guard: Sequence[Any] = (),
    ) -> AsyncCheckpoint:
        """Copy this process's share into the host buffers (in the caller's thread) and run
        the rest of ``sequence`` in a writer thread; ``sequence.prepare()`` has succeeded.

        A failure of the copy (a save pre-hook raising, say) is reported by the writer, so
        that every process learns of it.

        Args:
            guard: the prepared optimizers; with ``snapshot_mode="overlapped"`` their large
                CPU parameters and state tensors are copied in the background, and their
                ``step()`` waits for that copy.

        Returns:
            The handle of the save.
        """
        self.wait_for_snapshot()  # the buffers are about to be reused
        fenced = [o for o in guard if isinstance(o, AcceleratedOptimizer)]
        if self.snapshot_mode != "overlapped":
            fenced = []

        writer = self._choose(sequence.storage, sequence.target)
        if writer == "process":
            if self.process is None:
                self.process = shared_writer()
            try:
                self.process.ensure()  # started here (the training thread), replaced if it died
            except OSError as exc:  # no process can be started (out of memory, pid limit)
                self._fall_back(f"the writer process could not be started ({exc})")
                writer = "thread"
        if writer == "process" and self._arena is None:
            self._arena = SharedArena()
            self.snapshot.clear()
            self.snapshot.allocate = self._allocate

        def freeze() -> Payload:
            live = take()
            defer = guarded_storages(fenced)
            frozen = self.snapshot.capture(live.contents, live.sharded, defer)
            if frozen.deferred is not None:
                self._fence(frozen.deferred, fenced)
            if self._arena is not None:
                self._arena.keep_only(list(self.snapshot.buffers().values()))
            if writer == "process" and not self._shared_failed and not self._cuda_state:
                assert self._arena is not None and self.process is not None
                self.last_writer = "process"
                return ProcessPayload(frozen, self._arena, self.process)
            self.last_writer = "thread"
            return frozen

        sequence.capture(freeze)
        handle = AsyncCheckpoint(sequence.target)
        thread = threading.Thread(
            target=self._run,
            args=(sequence, handle),
            name=f"accelkit-save-{sequence.request.iteration}",
            daemon=False,
        )
        self._pending, self._thread = handle, thread
        _IN_FLIGHT.add(thread)
        thread.start()
        return handle

    def _fence(self, deferred: DeferredCopy, optimizers: list[AcceleratedOptimizer]) -> None:
        """Make the optimizers' ``step()`` wait for ``deferred`` until it is done."""
        self._deferred = deferred
        for optimizer in optimizers:
            optimizer.before_step = self.wait_for_snapshot

        def clear() -> None:
            for optimizer in optimizers:
                optimizer.before_step = None

        deferred.add_done_callback(clear)  # at once if the copy has already finished

    def _choose(self, storage: Storage, target: str) -> str:
        """``"process"`` or ``"thread"`` for a save into ``target`` on ``storage``."""
        # Shared memory given back once it failed. Under "auto" with CUDA state it is kept:
        # it holds only the CPU tensors' buffers, which the thread reads as well as any.
        if self._shared_failed and self._arena is not None:
            self.snapshot.clear()
            self.snapshot.allocate = None
            self._arena.release()
            self._arena = None
        if self.writer == "thread":
            return "thread"
        available, why = process_writer_available()
        if not available:
            reason = why
        elif not isinstance(storage, LocalStorage):
            reason = (
                f"{storage.protocol}:// storage is not the local disk (the process writer writes "
                "local files only: an object store's clients and credentials live in the "
                "training process)"
            )
        elif self._shared_failed:
            reason = "shared memory for the snapshot could not be reserved earlier"
        elif self._cuda_state and self.writer == "auto":
            reason = _CUDA_REASON
        else:
            return "process"
        self._fall_back(reason)
        return "thread"

    def _fall_back(self, reason: str) -> None:
        if self.writer == "process" and reason not in self._warned:
            self._warned.add(reason)
            logger.warning(
                "async_writer='process': the writer thread writes this save instead, because "
                "%s. Pass ProjectConfiguration(async_writer='auto') to fall back silently.",
                reason,
            )
        else:
            logger.debug("The writer thread writes this asynchronous save: %s.", reason)

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A snapshot buffer in shared memory; ordinary memory (and the thread writer, with a
        warning) once that fails; ordinary pinned memory for CUDA tensors under ``"auto"``."""
        if pin and self.writer == "auto":
            # Tensors on a GPU: the thread writes this save and the next ones. On a GPU the
            # snapshot's blocking part is the device-to-host copy with either writer (1.03x a
            # pinned copy with both on an H200, 3 GB of state; throughput lost with a save
            # every 350 steps 1.40% thread, 1.31% process: benchmarks/results/cuda.json), and
            # torch's own page-locked memory needs no registration of shared memory with CUDA.
            # async_writer="process" asks for the writer process all the same (the CUDA tests
            # pass with it forced everywhere).
            if not self._cuda_state:
                self._cuda_state = True
                logger.debug("The writer thread writes asynchronous saves: %s.", _CUDA_REASON)
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        if not self._shared_failed and self._arena is not None:
            try:
                return self._arena.empty(shape, dtype, pin)
            except OSError as exc:
                self._shared_failed = True
                nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                logger.warning(
                    "Could not reserve %d bytes of shared memory for the checkpoint snapshot "
                    "(%s; %d bytes already held): the writer thread writes asynchronous saves "
                    "from now on, with ordinary memory. The process writer needs free memory "
                    "the size of the saved state; pass ProjectConfiguration("
                    "async_writer='thread') to silence this.",
                    nbytes,
                    exc,
                    self._arena.nbytes,
                )
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)

    def close(self) -> None:
        """Wait for the save in flight, then give back the shared memory (the writer process,
        shared by the interpreter's savers, stops at interpreter exit)."""
        self.wait()
        if self._arena is not None:
            if self.process is not None:
                self.process.forget(self._arena)
            self.snapshot.clear()
            self.snapshot.allocate = None
            self._arena.release()
            self._arena = None

    def _run(self, sequence: SaveSequence, handle: AsyncCheckpoint) -> None:
        error: BaseException | None = None
        try:
            sequence.finish()
        except BaseException as exc:
            error = exc
            logger.error("%s", exc, exc_info=exc)
        finally:
            _IN_FLIGHT.discard(threading.current_thread())
            handle._finish(error)  # last: a done handle means nothing is left to do


def guarded_storages(optimizers: Sequence[Any]) -> set[int]:
    """The storage addresses of the tensors only the optimizers' ``step()`` changes: the
    parameters of their ``param_groups`` and their state tensors, on the CPU and not sharded
    (GPU and DTensor state keeps the blocking path)."""
    found: set[int] = set()

    def add(value: Any) -> None:
        if (
            isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
            and getattr(value, "_local_tensor", None) is None
            and value.layout == torch.strided
        ):
            found.add(value.untyped_storage().data_ptr())

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                add(param)
        for per_param in optimizer.state.values():
            if isinstance(per_param, Mapping):
                for value in per_param.values():
                    add(value)
    found.discard(0)
    return found


# Threads of saves in flight, joined at interpreter exit.
_IN_FLIGHT: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _finish_saves_at_exit() -> None:
    for thread in list(_IN_FLIGHT):
        if thread.is_alive():
            logger.info("Waiting for the checkpoint save in flight (%s) to finish.", thread.name)
            thread.join()
    close_writers()  # then the writer processes (they exit at the end of their pipe)


# The first of the exit drains (accelkit.delivery.exit): a save in flight commits before the
# replication and tracker drains run, so its checkpoint is replicated and reported.
at_exit(_finish_saves_at_exit, SAVES, "waiting for the checkpoint saves in flight")
