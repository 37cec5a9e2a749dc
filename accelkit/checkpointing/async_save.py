"""Asynchronous saves: snapshot to host memory, write and commit in a background thread.

``save_state(async_save=True)`` does, on every process, only what must happen while the live
objects are still as they were at the call:

1. wait for the previous save (at most one is in flight) and raise its failure, if any;
2. prepare the folder exactly as a synchronous save does (the main process takes the
   project's save lock for an automatic checkpoint, checks and un-commits the folder; all
   processes agree on the outcome);
3. run the save pre-hooks and copy this process's share of the state into the reusable host
   buffers of a :class:`~accelkit.checkpointing.snapshot.HostSnapshot`;
4. start a writer thread and return an :class:`AsyncCheckpoint` handle.

The writer thread then follows the same commit protocol as a synchronous save: it writes this
process's files (each made durable), the processes exchange what they wrote (so the manifest is
written only after *every* process's files are), the main process writes ``accelkit.json`` (the
commit), then applies retention and gives the save lock back, and all processes meet once more
so that every handle completes only after the commit. The processes meet on a separate gloo
process group created once, at the first asynchronous save, so the writer's messages never
interleave with the training loop's collectives on the default group.

A failure is never silent: the writer logs it when it happens, and it is raised to the caller
once: by the handle (``result()`` raises it, ``exception()`` returns it) if the caller asks,
otherwise by the next ``save_state``, ``load_state``, ``wait_for_checkpoints`` or
``end_training``. A failure while copying the state (a save pre-hook raising, say) is reported
the same way, so that every process learns of it. A failed save is not committed and earlier
checkpoints are untouched (an automatically named folder is removed).

Sharded (FSDP) models and their optimizers work the same way: each process copies its own
shards (their DTensor layout kept) into the host buffers, and its writer thread writes them
with torch's distributed checkpoint, a collective of the writer threads on the separate gloo
group (never on the group training uses, and with host tensors only), inside the checkpoint's
``sharded/`` folder, before the manifest lists every process's files. The processes first agree
that every one of them captured its state, so a failed capture never leaves the others waiting
in that collective.

Interpreter exit with a save in flight waits for it to commit. A process killed meanwhile
leaves a folder without ``accelkit.json``, which loading and retention ignore by design.

Public API: :class:`AsyncCheckpoint` (the handle), :class:`AsyncSaver` (the engine).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from accelkit.checkpointing.contents import TrainingObjects, snapshot_contents, unwrap_model
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.manager import CheckpointManager, _agree
from accelkit.checkpointing.manifest import FileEntry
from accelkit.checkpointing.sharded import clear_sharded, sharded_targets, write_sharded
from accelkit.checkpointing.snapshot import FrozenSnapshot, HostSnapshot
from accelkit.checkpointing.storage import Storage, WrittenFile, sync_batch

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


@dataclass
class _Job:
    handle: AsyncCheckpoint
    storage: Storage
    target: str
    automatic: bool
    frozen: FrozenSnapshot | None
    capture_error: BaseException | None
    sharded: bool  # the save has a DCP step (the same on every process)
    iteration: int
    step: int
    metrics: dict[str, float]
    metadata: Mapping[str, Any] | None
    max_shard_size: int | str


def _failed(target: str, rank: int, detail: str) -> CheckpointError:
    return CheckpointError(
        f"Asynchronous save of {target} failed on process {rank}: {detail}. It was not "
        "committed; earlier checkpoints are untouched. Fix the cause and save again."
    )


class AsyncSaver:
    """Runs saves of one :class:`~accelkit.checkpointing.manager.CheckpointManager`, at most one
    in the background at a time.

    Args:
        manager: the run's checkpoint manager (its configuration, process state and hooks).
        snapshot: the host buffers to copy into; a new :class:`~accelkit.checkpointing.
            snapshot.HostSnapshot` by default. It holds one host copy of the saved tensors
            between saves.
    """

    def __init__(self, manager: CheckpointManager, snapshot: HostSnapshot | None = None) -> None:
        self.manager = manager
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

    def save(
        self,
        output_dir: str | os.PathLike[str] | None,
        objects: TrainingObjects,
        step: int = 0,
        async_save: bool | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_shard_size: int | str = "10GB",
    ) -> str | AsyncCheckpoint:
        """Save ``objects``: synchronously (returns the path) or in the background (returns
        an :class:`AsyncCheckpoint`). Waits for the previous save first and raises its failure.

        Args:
            async_save: ``None`` uses ``ProjectConfiguration.async_save``.
            (the others as :meth:`~accelkit.checkpointing.manager.CheckpointManager.save`)

        Raises:
            CheckpointError: the previous asynchronous save failed, or this one cannot start
                (the automatic folder exists...); a failure of the background write is raised
                later, see the module docstring.
        """
        self.wait()
        if async_save is None:
            async_save = bool(getattr(self.manager.config, "async_save", False))
        if not async_save:
            return self.manager.save(output_dir, objects, step, metrics, metadata, max_shard_size)
        return self._submit(output_dir, objects, step, metrics, metadata, max_shard_size)

    # ------------------------------------------------------------------ the caller's part

    def _coordination_group(self) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            # Every process reaches its first asynchronous save_state, so all create it here,
            # in the same order relative to any other group. Even on one process: the writer
            # must not run a collective (DCP's) on the group the training loop uses.
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _submit(
        self,
        output_dir: str | os.PathLike[str] | None,
        objects: TrainingObjects,
        step: int,
        metrics: Mapping[str, float] | None,
        metadata: Mapping[str, Any] | None,
        max_shard_size: int | str,
    ) -> AsyncCheckpoint:
        manager = self.manager
        target, automatic = manager._output_dir(output_dir)
        storage = manager.storage(target)
        iteration = manager.config.iteration
        main = manager.state.is_main_process
        error: BaseException | None = None
        hold_lock = main and automatic  # the project's save lock, held until the commit
        if main:
            try:
                if hold_lock:
                    manager._hold_run_lock()
                manager._prepare_folder(storage, target, automatic)
            except Exception as exc:
                error = exc
        try:
            _agree(error, f"Preparing {target}")
        except BaseException:
            if hold_lock:
                manager._release_run_lock()
            raise
        self._coordination_group()
        manager.config.iteration = iteration + 1  # the number is spent, whatever happens
        frozen: FrozenSnapshot | None = None
        capture_error: BaseException | None = None
        has_sharded = False
        try:
            targets = sharded_targets(objects.models, objects.optimizers)
            has_sharded = bool(targets)
            sharded = targets.state_dict() if targets else None
            objects = targets.remaining(objects)  # the rest is saved as without FSDP
            models = list(objects.models)
            weights = [unwrap_model(m).state_dict() for m in models]
            for hook in list(manager._save_hooks.values()):
                hook(models, weights, target)
            live = snapshot_contents(objects, weights, manager.state.process_index, main)
            frozen = self.snapshot.capture(live, sharded)
        except Exception as exc:  # reported by the writer, so every process learns of it
            capture_error = exc
        handle = AsyncCheckpoint(target)
        job = _Job(
            handle=handle,
            storage=storage,
            target=target,
            automatic=automatic,
            frozen=frozen,
            capture_error=capture_error,
            sharded=has_sharded,
            iteration=iteration,
            step=int(step),
            metrics={str(k): float(v) for k, v in (metrics or {}).items()},
            metadata=dict(metadata or {}),
            max_shard_size=max_shard_size,
        )
        thread = threading.Thread(
            target=self._run, args=(job,), name=f"accelkit-save-{iteration}", daemon=False
        )
        self._pending, self._thread = handle, thread
        _IN_FLIGHT.add(thread)
        thread.start()
        return handle

    # ------------------------------------------------------------------ the writer's part

    def _exchange(self, item: Any) -> list[Any]:
        if self._group is None:
            return [item]
        out: list[Any] = [None] * self.manager.state.num_processes
        dist.all_gather_object(out, item, group=self._group)
        return out

    def _write_sharded(
        self, job: _Job, error: BaseException | None
    ) -> tuple[list[FileEntry], BaseException | None]:
        """Every process's shards through DCP (a collective on the coordination group), once
        all processes captured their state and the main process cleared ``sharded/``.

        Returns:
            This process's files, and its failure (``error`` if it already had one).
        """
        if error is None and self.manager.state.is_main_process:
            try:
                clear_sharded(job.storage, job.target)
            except Exception as exc:
                error = exc
        ready = self._exchange(error is None)
        if error is not None or not all(ready):
            return [], error  # the process(es) that failed report why in the next exchange
        assert job.frozen is not None and job.frozen.sharded is not None
        try:
            job.frozen.wait_copies()
            state = job.frozen.sharded
            return write_sharded(job.storage, job.target, state, self._group), None
        except Exception as exc:
            return [], exc

    def _run(self, job: _Job) -> None:
        main = self.manager.state.is_main_process
        error: BaseException | None = None
        try:
            self._write_and_commit(job)
        except BaseException as exc:
            error = exc
            if job.automatic and main:
                self.manager._discard(job.storage, job.target)
            logger.error("%s", exc, exc_info=exc)
        finally:
            job.frozen = None
            if job.automatic and main:
                self.manager._release_run_lock()
            _IN_FLIGHT.discard(threading.current_thread())
            job.handle._finish(error)  # last: a done handle means nothing is left to do

    def _write_and_commit(self, job: _Job) -> None:
        manager = self.manager
        rank = manager.state.process_index
        main = manager.state.is_main_process
        written: dict[str, WrittenFile] = {}
        entries: list[FileEntry] = []
        error = job.capture_error
        if job.sharded:
            entries, error = self._write_sharded(job, error)
        if error is None and job.frozen is not None:
            try:
                with sync_batch():  # fsync each file while the next one is written
                    written = job.frozen.write(job.storage, job.target, job.max_shard_size)
            except Exception as exc:
                error = exc
        job.frozen = None  # the buffers may be reused once this save is over
        entries += [FileEntry(name, w.size, w.checksum) for name, w in written.items()]
        detail = None if error is None else f"{type(error).__name__}: {error}"
        gathered = self._exchange((entries, detail))
        if error is not None:
            raise _failed(job.target, rank, f"{detail}") from error
        for other, (_, failure) in enumerate(gathered):
            if failure is not None:
                raise _failed(job.target, other, failure)
        commit_error: BaseException | None = None
        if main:
            try:
                files = {e.path: e for part, _ in gathered for e in part}
                manager._commit(
                    job.storage,
                    job.target,
                    files,
                    job.iteration,
                    job.step,
                    job.metrics,
                    job.metadata,
                )
            except Exception as exc:
                commit_error = exc
        flags = self._exchange(None if commit_error is None else repr(commit_error))
        if commit_error is not None:
            raise _failed(job.target, rank, f"committing: {commit_error!r}") from commit_error
        if flags[0] is not None:
            raise _failed(job.target, 0, f"committing: {flags[0]}")
        if main and job.automatic:
            manager._apply_retention(job.storage, job.target)  # logs its own failures
        self._exchange(None)  # every handle completes after the commit and the retention


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
