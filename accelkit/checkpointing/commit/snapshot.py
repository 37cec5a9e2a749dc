"""A host-memory copy of what one process saves, in one reusable set of buffers.

An asynchronous save must let training change the model, the optimizer and every registered
object the moment ``save_state`` returns, while a background thread still writes the files.
:class:`HostSnapshot` makes that possible: :meth:`HostSnapshot.capture` copies this process's
share of the checkpoint (a :class:`~accelkit.checkpointing.objects.contents.Snapshot` of live
tensors) into host buffers and returns a :class:`FrozenSnapshot` that no later change of the
live objects can reach; :meth:`FrozenSnapshot.write` writes it with the same file formats as a
synchronous save (it is a :class:`~accelkit.checkpointing.commit.payload.Payload`).

Memory: the buffers cost **one host copy of the saved tensors** of this process (model weights,
optimizer state, tensors of registered objects; of a sharded FSDP model and its optimizer only
this process's shards), allocated at the first save and reused by every
later one (a tensor that keeps its dtype and size keeps its buffer); buffers no longer used by
the newest save are released. They are never reused while a write from them is in flight:
:class:`~accelkit.checkpointing.manager.CheckpointManager` keeps at most one save in flight
and waits for it before capturing the next. Non-tensor values (numbers, strings, RNG states) are
copied too, at a negligible cost.

Speed: CUDA tensors go to *pinned* host buffers with non-blocking copies on a side stream
that first waits for the current stream; the current stream then waits for the copies, so the
caller never blocks on the GPU and training kernels queued after ``save_state`` cannot change a
tensor before it is copied. The writer thread waits for the copies (a CUDA event) before it
reads the buffers. CPU tensors are copied into the reused buffers before ``capture`` returns
(plain ``memmove`` calls, split among up to 4 threads: the caller is blocked meanwhile anyway).

Overlapped copies (``ProjectConfiguration.async_snapshot="overlapped"``): ``capture(defer=...)``
names the storages of *guarded* tensors (the parameters and state of the prepared optimizers,
which only their ``step()`` changes); large contiguous CPU tensors among them are not copied
before ``capture`` returns but by one background thread (:class:`DeferredCopy`, ``memmove``
calls that release the GIL, straight into the same buffers), while the caller goes on with the
next forward and backward. Everything else (small tensors, buffers that ``forward`` changes,
registered objects, CUDA and sharded state) is copied as above. Whoever may change a guarded
tensor waits for :meth:`DeferredCopy.wait` first (the fence, see
:mod:`~accelkit.checkpointing.commit.async_save`).

A change the fence does not see (an in-place update, through ``.data``, ``numpy()`` or any other
path, right after ``save_state``) must never reach a committed checkpoint, so the deferred
tensors are checked by content, not by version counter (which ``.data`` writes do not move, and
which moves only when an in-place operation *ends*, so that one still running while its tensor
is copied escaped it). Before ``capture`` returns, the bytes of each deferred tensor are hashed
in place (XXH3-64 per 16 MiB piece, :func:`~accelkit.checkpointing.storage.checksum.
memory_digest`, split among the same threads as the copies): a read, about two thirds of the
time of a copy (256 MiB: 30 ms against 45 ms on the 2-core VM). Once the background thread has
copied everything (and released the fence) it hashes what it copied, and the writer, in
:meth:`FrozenSnapshot.wait_copies`, fails the save if any piece differs: the copy is not the
state at ``save_state``. Without ``xxhash`` nothing is deferred.

Public API: :class:`HostSnapshot` (``capture``, ``clear``, ``nbytes``), :class:`FrozenSnapshot`
(``wait_copies``, ``write``, ``write_sharded``, ``has_sharded``, ``nbytes``),
:class:`DeferredCopy` (``wait``, ``done``, ``add_done_callback``, ``check``).
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.formats import state_io
from accelkit.checkpointing.formats.manifest import FileEntry
from accelkit.checkpointing.formats.model_io import write_model_files
from accelkit.checkpointing.objects.contents import Snapshot
from accelkit.checkpointing.sharded import write_sharded
from accelkit.checkpointing.storage import Storage, WrittenFile
from accelkit.checkpointing.storage._pools import thread_pool
from accelkit.checkpointing.storage.checksum import MEMORY_DIGEST_AVAILABLE, memory_digest

__all__ = ["DeferredCopy", "FrozenSnapshot", "HostSnapshot"]

logger = logging.getLogger(__name__)

# A buffer is identified by where its tensor sits in the checkpoint: (kind, stem, name).
_Key = tuple[str, str, str]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _EncodedState:
    """One object state, split by :func:`~accelkit.checkpointing.formats.state_io.encode_state`:
    a JSON tree (already a fresh structure), its tensors (host copies) and torch-only extras."""

    stem: str
    tree: Any
    tensors: dict[str, torch.Tensor]
    extras: list[Any]


@dataclass
class FrozenSnapshot:
    """This process's share of one checkpoint, copied out of the live objects.

    Attributes:
        models: ``(stem, state_dict of host tensors)`` per model file.
        states: the object states, encoded, with host tensors.
        sharded: the sharded (FSDP) state, same structure as the live one, every DTensor's
            local shard in a host buffer (written with DCP, see
            :func:`~accelkit.checkpointing.sharded.write_sharded`); ``None`` without FSDP.
        events: CUDA events the copies into pinned buffers complete at.
        deferred: the background copy of an overlapped capture, or ``None``.
    """

    models: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    states: list[_EncodedState] = field(default_factory=list)
    sharded: dict[str, Any] | None = None
    events: list[Any] = field(default_factory=list)
    deferred: DeferredCopy | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held (buffers shared by tied weights counted once)."""
        seen: set[int] = set()
        total = 0
        tensors = [t for _, sd in self.models for t in sd.values()]
        tensors += [t for s in self.states for t in s.tensors.values()]
        tensors += _host_tensors(self.sharded)
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += _nbytes(t)
        return total

    @property
    def has_sharded(self) -> bool:
        """Whether it holds sharded (FSDP) state (see :meth:`write_sharded`)."""
        return self.sharded is not None

    def write_sharded(self, storage: Storage, folder: str, group: Any) -> list[FileEntry]:
        """Write the sharded state into ``<folder>/sharded`` with DCP: a collective of the
        processes of ``group`` (see :func:`~accelkit.checkpointing.sharded.write_sharded`)."""
        assert self.sharded is not None
        self.wait_copies()
        return write_sharded(storage, folder, self.sharded, group)

    def wait_copies(self) -> None:
        """Block until every copy of this snapshot has finished (device-to-host copies and
        the background copy of an overlapped capture, and that copy's check).

        Raises:
            CheckpointError: a deferred tensor was changed before it was copied, by any path
                (see :meth:`DeferredCopy.check`); the snapshot must not be written.
        """
        for event in self.events:
            event.synchronize()
        self.events = []
        if self.deferred is not None:
            self.deferred.wait()
            self.deferred.check()

    def write(
        self, storage: Storage, folder: str, max_shard_size: int | str = "10GB"
    ) -> dict[str, WrittenFile]:
        """Write the files (the same names and formats as a synchronous save) into ``folder``.

        Returns:
            Relative file name -> :class:`~accelkit.checkpointing.storage.WrittenFile`.
        """
        self.wait_copies()
        written: dict[str, WrittenFile] = {}
        for stem, state_dict in self.models:
            written.update(write_model_files(storage, folder, state_dict, stem, max_shard_size))
        for state in self.states:
            written.update(_write_encoded(storage, folder, state))
        return written


def _host_tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state (a DTensor counts as its local shard)."""
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _host_tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _host_tensors(v)]
    if isinstance(tree, torch.Tensor):
        return [getattr(tree, "_local_tensor", tree)]
    return []


def _write_encoded(storage: Storage, folder: str, state: _EncodedState) -> dict[str, WrittenFile]:
    return state_io.write_encoded(
        storage, folder, state.stem, state.tree, state.tensors, state.extras
    )


@dataclass
class _Deferred:
    """One tensor left to the background copy: its memmoves ``(dst, src, bytes)`` and, per
    piece, the digest of the source bytes at capture."""

    name: str
    source: torch.Tensor | None  # alive until copied
    target: torch.Tensor  # the snapshot buffer: alive until checked
    pieces: list[tuple[int, int, int]]
    digests: list[int] = field(default_factory=list)

    def digest_sources(self, index: int) -> None:
        """Hash the source bytes of piece ``index`` (at capture, before training goes on)."""
        _, src, nbytes = self.pieces[index]
        self.digests[index] = memory_digest(src, nbytes)

    def matches(self) -> bool:
        """Whether the copied bytes are the bytes hashed at capture."""
        return all(
            memory_digest(dst, nbytes) == digest
            for (dst, _, nbytes), digest in zip(self.pieces, self.digests, strict=True)
        )


class DeferredCopy:
    """The background part of an overlapped capture: one thread copying the large guarded
    tensors into their snapshot buffers while training goes on, then checking the copies.

    Each tensor's bytes were hashed at capture (:attr:`_Deferred.digests`). Once every tensor
    is copied, the fence is released (:meth:`wait` returns, the done callbacks run) and the
    thread hashes the copies: a tensor whose copy differs was changed, by whatever path, after
    ``save_state`` and before its copy, so the copy may mix old and new values, and
    :meth:`check` fails the save. A tensor changed after its copy is not reported: its copy is
    the state at ``save_state``.
    """

    def __init__(self, items: list[_Deferred]) -> None:
        self._items = items
        self._copied = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.nbytes = sum(n for item in items for _, _, n in item.pieces)
        """Bytes copied in the background."""
        self.changed: list[str] = []
        """The tensors whose copy differs from their bytes at capture."""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="accelkit-snapshot-copy")
        self._thread.daemon = True
        self._thread.start()

    def done(self) -> bool:
        """Whether every deferred tensor has been copied (the copies may still be checked)."""
        return self._copied.is_set()

    def wait(self) -> None:
        """Block until every deferred tensor has been copied, so the live tensors may change
        (never raises, and does not wait for the check: see :meth:`check`)."""
        self._copied.wait()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the copies are done: at once if they are already, else in
        the copy thread, before :meth:`wait` returns."""
        with self._lock:
            if not self._copied.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def check(self) -> None:
        """Wait until the copies are checked; raise if they failed or a tensor was changed
        before it was copied.

        Raises:
            CheckpointError: naming the tensors, and the fix.
        """
        self._done.wait()
        if self.error is not None:
            raise CheckpointError(
                f"The background copy of the checkpoint snapshot failed ({self.error!r}); "
                "the save is not committed."
            ) from self.error
        if self.changed:
            names = ", ".join(self.changed[:8]) + (
                f" and {len(self.changed) - 8} more" if len(self.changed) > 8 else ""
            )
            raise CheckpointError(
                f"Overlapped snapshot: {names} changed after save_state() returned and "
                "before its background copy (its bytes no longer match the checksum taken at "
                "save_state), so the copy may mix old and new values; the save is not "
                "committed (earlier checkpoints are untouched). Call "
                "accelerator.wait_for_snapshot() before changing parameters or optimizer state "
                "outside the prepared optimizer's step() (in place, through .data, copy_(), "
                "an EMA swap...), or use ProjectConfiguration(async_snapshot='blocking')."
            )

    def _run(self) -> None:
        items, self._items = self._items, []
        try:
            for item in items:
                _deferred_memmoves(item.pieces)
                item.source = None  # the live tensor is no longer needed
        except BaseException as exc:  # reported by check(), to the writer
            self.error = exc
        finally:
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # a fence not cleared costs one wait() per step
                    logger.exception("A callback of the snapshot's background copy failed.")
            self._copied.set()  # the fence: training may change the live tensors now
        try:
            if self.error is None:
                self.changed = [item.name for item in items if not item.matches()]
        except BaseException as exc:
            self.error = exc
        finally:
            self._done.set()


def _deferred_memmoves(pieces: list[tuple[int, int, int]]) -> None:
    """The background copy of one tensor (tests replace it to hold the copy back)."""
    _memmoves(pieces)


# Smaller guarded tensors are copied at once: a thread hand-off is not worth it for them.
_DEFER_MIN_BYTES = 64 * 1024


def _tensor_name(key: _Key) -> str:
    kind, stem, name = key
    return f"{name!r} of {stem}" if kind == "model" else f"{stem}: {name!r}"


class _Copier:
    """Copies tensors of one capture into reused buffers; CUDA copies go on side streams."""

    def __init__(self, owner: HostSnapshot, defer: Collection[int] = ()) -> None:
        self.owner = owner
        self.defer = defer  # storage addresses of guarded tensors: large ones copied later
        self.deferred: list[_Deferred] = []
        self.used: dict[_Key, torch.Tensor] = {}
        self.by_view: dict[tuple[Any, ...], torch.Tensor] = {}
        self.streams: dict[torch.device, Any] = {}
        self.pieces: list[tuple[int, int, int]] = []  # (dst, src, bytes) of host memmoves
        self.sources: list[torch.Tensor] = []

    def _stream(self, device: torch.device) -> Any:
        stream = self.streams.get(device)
        if stream is None:
            stream = self.owner._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self.streams[device] = stream
        return stream

    def copy(self, key: _Key, tensor: torch.Tensor) -> torch.Tensor:
        src = tensor.detach()
        if src.layout != torch.strided or src.is_quantized:
            return src.to("cpu", copy=True)  # rare; written as a torch extra
        view_key = (
            src.device,
            src.untyped_storage().data_ptr(),
            src.storage_offset(),
            src.dtype,
            tuple(src.shape),
            tuple(src.stride()),
        )
        if src.numel() > 0:
            shared = self.by_view.get(view_key)
            if shared is not None:  # the very same view (tied weights): one buffer
                return shared
        on_cuda = src.device.type == "cuda"
        buffer = self.owner._buffer(key, src, pinned=on_cuda)
        self.used[key] = buffer
        if on_cuda:
            stream = self._stream(src.device)
            with torch.cuda.stream(stream):
                buffer.copy_(src, non_blocking=True)
            src.record_stream(stream)
        elif src.is_contiguous() and not (src.is_conj() or src.is_neg()):
            # Plain memmoves (GIL released), run at finish() by a few threads: on a busy
            # machine several times faster than torch's copy, whose threads wait for each other.
            nbytes = _nbytes(src)
            pieces = [
                (
                    buffer.data_ptr() + start,
                    src.data_ptr() + start,
                    min(_COPY_PIECE, nbytes - start),
                )
                for start in range(0, nbytes, _COPY_PIECE)
            ]
            if (
                self.defer
                and key[0] != "sharded"
                and nbytes >= _DEFER_MIN_BYTES
                and src.untyped_storage().data_ptr() in self.defer
            ):
                self.deferred.append(
                    _Deferred(_tensor_name(key), src, buffer, pieces, [0] * len(pieces))
                )
            else:
                self.pieces.extend(pieces)
                self.sources.append(src)  # alive until copied
        else:
            buffer.copy_(src)
        if src.numel() > 0:
            self.by_view[view_key] = buffer
        return buffer

    def _copy_host(self) -> None:
        """Run the host memmoves and hash the deferred tensors' bytes, split among up to
        :data:`_COPY_THREADS` threads (one copy thread cannot use the memory bandwidth of a
        machine; 1 GB: 0.11 s -> 0.07 s with 2 threads on the 2-core VM measured)."""
        work: list[Callable[[], Any]] = [partial(ctypes.memmove, *p) for p in self.pieces]
        for item in self.deferred:
            work += [partial(item.digest_sources, i) for i in range(len(item.pieces))]
        self.pieces = []
        threads = min(_COPY_THREADS, os.cpu_count() or 1, len(work))
        if threads > 1:
            pool = thread_pool("copy", _COPY_THREADS - 1)
            futures = [pool.submit(_run_all, work[i::threads]) for i in range(1, threads)]
            _run_all(work[::threads])
            for future in futures:
                future.result()
        else:
            _run_all(work)
        self.sources = []

    def finish(self) -> list[Any]:
        """Complete the host copies (not the deferred ones: see :class:`DeferredCopy`); return
        the CUDA events the device copies complete at."""
        self._copy_host()
        events = []
        for device, stream in self.streams.items():
            events.append(stream.record_event())
            # Kernels queued after save_state (optimizer.step) wait for the copies.
            torch.cuda.current_stream(device).wait_stream(stream)
        return events


_COPY_PIECE = 16 * 1024 * 1024
_COPY_THREADS = 4


def _memmoves(pieces: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)


def _run_all(work: list[Callable[[], Any]]) -> None:
    for job in work:
        job()


def _copy_sharded(copier: _Copier, path: str, value: Any) -> Any:
    """A host copy of a nested sharded state: DTensors keep their spec (mesh, placements,
    global shape) around a host copy of their local shard, as DCP's own staging does."""
    if isinstance(value, Mapping):
        return {k: _copy_sharded(copier, f"{path}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_copy_sharded(copier, f"{path}.{i}", v) for i, v in enumerate(value)]
        return type(value)(items) if isinstance(value, list) else tuple(items)
    if isinstance(value, torch.Tensor):
        if getattr(value, "_local_tensor", None) is None:  # not a DTensor (no import needed)
            return copier.copy(("sharded", path, ""), value)
        from torch.distributed.tensor import DTensor

        assert isinstance(value, DTensor)
        host = copier.copy(("sharded", path, ""), value._local_tensor)
        # The constructor, not DTensor.from_local: that would move the shard back to the
        # mesh's device.
        return DTensor(host, value._spec, requires_grad=False)
    return _copy_plain(value)


def _copy_plain(value: Any) -> Any:
    """A copy of a non-tensor value that later changes of the live one cannot reach."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype)):
        return value
    return copy.deepcopy(value)


class HostSnapshot:
    """One reusable set of host buffers that checkpoints are copied into.

    Holds one host copy of the saved tensors of this process between saves (see the module
    docstring); call :meth:`clear` to give that memory back.

    Args:
        pin_memory: use pinned (page-locked) buffers for CUDA tensors, so device-to-host copies
            are asynchronous and run at full bus speed. Falls back to ordinary memory, with a
            warning, if pinning fails.
        allocate: ``allocate(shape, dtype, pin)`` makes a new buffer (the shared memory of the
            process writer: :meth:`~accelkit.checkpointing.commit.writer_process.SharedArena.
            empty`); ordinary host memory by default.
    """

    def __init__(
        self,
        pin_memory: bool = True,
        allocate: Callable[[torch.Size, torch.dtype, bool], torch.Tensor] | None = None,
    ) -> None:
        self.pin_memory = pin_memory
        self.allocate = allocate
        self._buffers: dict[_Key, torch.Tensor] = {}
        self._pinned: dict[_Key, bool] = {}
        self._streams: dict[torch.device, Any] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold now."""
        return sum(_nbytes(b) for b in self._buffers.values())

    def buffers(self) -> Mapping[_Key, torch.Tensor]:
        """The buffers, by ``(kind, stem, name)`` (read-only use: tests and diagnostics)."""
        return dict(self._buffers)

    def clear(self) -> None:
        """Release every buffer (the next capture allocates them again)."""
        self._buffers.clear()
        self._pinned.clear()

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device] = stream
        return stream

    def _buffer(self, key: _Key, src: torch.Tensor, pinned: bool) -> torch.Tensor:
        old = self._buffers.get(key)
        pin = pinned and self.pin_memory
        if (
            old is not None
            and old.dtype == src.dtype
            and old.numel() == src.numel()
            and self._pinned.get(key) == pin
        ):
            return old.view(src.shape)
        if self.allocate is not None:
            buffer = self.allocate(src.shape, src.dtype, pin)
            self._buffers[key], self._pinned[key] = buffer, pin
            return buffer
        try:
            buffer = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        except RuntimeError as exc:
            if not pin:
                raise
            logger.warning(
                "Could not pin %d bytes of host memory for the checkpoint snapshot (%s); "
                "using ordinary memory, so device-to-host copies block.",
                _nbytes(src),
                exc,
            )
            self.pin_memory = False
            pin = False
            buffer = torch.empty(src.shape, dtype=src.dtype, device="cpu")
        self._buffers[key], self._pinned[key] = buffer, pin
        return buffer

    def capture(
        self,
        snapshot: Snapshot,
        sharded: Mapping[str, Any] | None = None,
        defer: Collection[int] = (),
    ) -> FrozenSnapshot:
        """Copy ``snapshot`` (live tensors and states) into the buffers.

        Must not be called while a :class:`FrozenSnapshot` from an earlier capture is still
        being written, or its deferred copy is still running or being checked: its buffers
        are reused.

        Args:
            snapshot: this process's unsharded contents.
            sharded: this process's sharded (FSDP) state, from
                :meth:`~accelkit.checkpointing.sharded.ShardedTargets.state_dict`; only the
                local shards are copied.
            defer: ``untyped_storage().data_ptr()`` of the guarded tensors (see the module
                docstring): those of at least 64 KiB, contiguous and on the CPU, are copied by
                a background thread after ``capture`` returns (:attr:`FrozenSnapshot.deferred`),
                their bytes hashed before it returns; empty (or without ``xxhash``): everything
                is copied before it returns.

        Returns:
            The copy; call :meth:`FrozenSnapshot.write` (from any thread) to write it.
        """
        copier = _Copier(self, defer if MEMORY_DIGEST_AVAILABLE else ())
        frozen = FrozenSnapshot()
        for stem, state_dict in snapshot.models:
            frozen.models.append(
                (
                    stem,
                    {
                        name: copier.copy(("model", stem, name), value)
                        if isinstance(value, torch.Tensor)
                        else _copy_plain(value)
                        for name, value in state_dict.items()
                    },
                )
            )
        for stem, state in snapshot.states:
            # The encoder builds a fresh JSON tree; only tensors and extras can still be
            # reached from the live object.
            tree, tensors, extras = state_io.encode_state(state)
            host = {k: copier.copy(("state", stem, k), t) for k, t in tensors.items()}
            frozen.states.append(_EncodedState(stem, tree, host, copy.deepcopy(extras)))
        if sharded is not None:
            frozen.sharded = {k: _copy_sharded(copier, k, v) for k, v in sharded.items()}
        frozen.events = copier.finish()
        if copier.deferred:
            frozen.deferred = DeferredCopy(copier.deferred)
        for key in [k for k in self._buffers if k not in copier.used]:
            del self._buffers[key]  # not part of the newest checkpoint: give it back
            self._pinned.pop(key, None)
        return frozen
