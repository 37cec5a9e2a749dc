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

A failure is never silent: the writer logs it when it happens, and it is raised to the caller
once: by the handle (``result()`` raises it, ``exception()`` returns it) if the caller asks,
otherwise by the next ``save_state``, ``load_state``, ``wait_for_checkpoints`` or
``end_training``. A failure while copying the state (a save pre-hook raising, say) is reported
the same way, so that every process learns of it. A failed save is not committed and earlier
checkpoints are untouched (an automatically named folder is removed).

Interpreter exit with a save in flight waits for it to commit. A process killed meanwhile
leaves a folder without ``accelkit.json``, which loading and retention ignore by design.

Public API: :class:`AsyncCheckpoint` (the handle), :class:`AsyncSaver` (the driver).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from accelkit.checkpointing.commit.payload import LivePayload
from accelkit.checkpointing.commit.protocol import GroupCoordinator, ProcessIdentity, SaveSequence
from accelkit.checkpointing.commit.snapshot import FrozenSnapshot, HostSnapshot

__all__ = ["AsyncCheckpoint", "AsyncSaver"]

logger = logging.getLogger(__name__)


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

    def __init__(self, snapshot: HostSnapshot | None = None) -> None:
        self.snapshot = snapshot or HostSnapshot()
        self._pending: AsyncCheckpoint | None = None
        self._thread: threading.Thread | None = None
        self._group: Any = None

    @property
    def pending(self) -> AsyncCheckpoint | None:
        """The handle of the save not yet waited for by :meth:`wait`, if any."""
        return self._pending

    def wait(self) -> None:
        """Block until the save in flight has finished; raise its failure unless the caller
        already got it from the handle.

        Raises:
            CheckpointError: the save failed; it was not committed.
        """
        handle, thread = self._pending, self._thread
        if handle is None:
            return
        if thread is not None:
            thread.join()
        self._pending, self._thread = None, None
        if handle._error is not None and not handle._seen:
            raise handle._error

    def coordinator(self, state: ProcessIdentity) -> GroupCoordinator:
        """The writer's coordinator: a gloo group of its own, created at the first
        asynchronous save (every process reaches it there, in the same order relative to any
        other group). Even on one process: the writer must not run a collective (DCP's) on the
        group the training loop uses."""
        if dist.is_available() and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return GroupCoordinator(self._group, state.process_index, state.num_processes)

    def start(self, sequence: SaveSequence, take: Callable[[], LivePayload]) -> AsyncCheckpoint:
        """Copy this process's share into the host buffers (in the caller's thread) and run
        the rest of ``sequence`` in a writer thread; ``sequence.prepare()`` has succeeded.

        A failure of the copy (a save pre-hook raising, say) is reported by the writer, so
        that every process learns of it.

        Returns:
            The handle of the save.
        """

        def freeze() -> FrozenSnapshot:
            live = take()
            return self.snapshot.capture(live.contents, live.sharded)

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


# Threads of saves in flight, joined at interpreter exit.
_IN_FLIGHT: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _finish_saves_at_exit() -> None:
    for thread in list(_IN_FLIGHT):
        if thread.is_alive():
            logger.info("Waiting for the checkpoint save in flight (%s) to finish.", thread.name)
            thread.join()


# Registered through threading's own exit hooks (as concurrent.futures does), which run before
# the interpreter joins threads and, being registered later, before the thread pools that write
# and fsync files shut down; plain atexit would run too late for them.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_saves_at_exit)
else:  # pragma: no cover - every supported Python has it
    atexit.register(_finish_saves_at_exit)
