"""Compare two committed accelkit checkpoints: what ``accelkit ckpt diff A B`` reports.

Tensors (the models' weights and every tensor of an object state: optimizer moments, the
RNG states, registered objects) are matched by name: ``model/0.weight``,
``optimizer/state/0.weight/exp_avg`` (named as ``accelkit ckpt inspect`` names them), whatever
file or shard holds them. Each is *added*, *removed*, changed in *dtype* or *shape*, or
changed in *values*; for a changed tensor of the same shape the differences are measured
elementwise in float64: ``max_abs = max |a - b|``, ``max_rel = max |a - b| / |a|`` (relative
to A; an element that was 0 in A and is not in B makes it infinite, as does a NaN on one side
only). The structure of every object state (an optimizer's param groups and hyperparameters,
a scheduler, the scaler, a dataloader's position, registered objects, the Python and NumPy
generator states) is compared value by value, and so are the manifest's iteration, step,
world size, metadata and metrics.

Reading streams: each safetensors file is read once, in data order, and checked against its
manifest checksum as it is read (a damaged file raises, as ``load_state`` would, at the point
of the comparison where the file ends). Each side is read by a thread of its own, in pieces of
at most 8 MiB (``_PIECE``) into at most ``1 + _READ_AHEAD`` (4) buffers reused from piece to
piece: the reads of A and B, the checksums and the comparison overlap, and no fresh memory is
faulted in per tensor. A piece goes back to its reader once compared. A tensor of A is compared
with its twin of B piece by piece as both arrive when they have one dtype and B's stream holds
the twin next; otherwise (another dtype, or B storing the tensors in another order) the two are
compared whole, copied out of the buffers. Memory is thus bounded by the buffers (32 MiB per
side) plus the two tensors compared whole where the dtype changed, plus, when B stores the
tensors in another order, the tensors of B read ahead of their twin in A. A changed tensor is
measured in float64 chunks of 32768 elements in three work buffers (256 KiB each). Two
checkpoints take about the time of reading both (``benchmarks/bench_export.py``).

Sharded (FSDP2, DCP) state is refused by name: its tensors are spread over per-rank files.

Public API: :func:`diff_checkpoints` -> :class:`CheckpointDiff` (with :class:`TensorChange`
and :class:`ValueChange` entries).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import queue
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpointing.catalog.inspect import (
    key_text,
    name_state_tensors,
    named_path,
    parameter_names,
    read_safetensors_header,
)
from accelkit.checkpointing.catalog.listing import (
    ACCELERATE,
    COMMITTED,
    CORRUPT,
    INCOMPLETE,
    CheckpointInfo,
    inspect_folder,
    list_checkpoints,
    loadable_automatic,
)
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.dcp_metadata import SHARDED_DIRNAME, has_sharded_state
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import (
    CHECKPOINTS_DIRNAME,
    KINDS,
    MANIFEST_NAME,
    SAVE_MARKER_NAME,
    STRUCTURE_SUFFIX,
    TENSORS_SUFFIX,
    TORCH_SUFFIX,
)
from accelkit.checkpointing.formats.manifest import FileEntry, Manifest
from accelkit.checkpointing.formats.safetensors_header import TensorInfo
from accelkit.checkpointing.formats.safetensors_io import SafetensorsStream
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.confined import confine
from accelkit.checkpointing.storage.verified import read_verified_bytes
from accelkit.errors import AccelkitError

__all__ = ["CheckpointDiff", "TensorChange", "ValueChange", "diff_checkpoints"]

ADDED = "added"
REMOVED = "removed"
DTYPE = "dtype"
SHAPE = "shape"
VALUES = "values"

_MODEL_FILE = re.compile(
    f"^({KINDS['model'].stem}(?:_\\d+)?)(?:-\\d{{5}}-of-\\d{{5}})?{re.escape(TENSORS_SUFFIX)}$"
)
_MODEL_INDEX = re.compile(
    f"^{KINDS['model'].stem}(?:_\\d+)?{re.escape(TENSORS_SUFFIX)}\\.index\\.json$"
)
_STATE_FILE = re.compile(
    "^(?:" + "|".join(k.pattern(shards=False) for n, k in KINDS.items() if n != "model") + ")$"
)
# Elements of a changed tensor compared at a time (256 KiB in float64): torch runs an
# operation on fewer than 32768 elements (its grain size) or exactly that many on the calling
# thread, with no OpenMP team, whose threads wait on each other on a loaded machine (0.18 s for
# 16M elements beside a busy thread at this size, 1.3-2 s at 64K-256K).
_CHUNK = 1 << 15
_PIECE = 8 << 20  # bytes of a tensor read at a time (a multiple of 8: whole elements)
_READ_AHEAD = 3  # pieces each side's reader thread may read beyond the one compared
_Piece = tuple[TensorInfo, torch.dtype, int, torch.Tensor]  # info, dtype, offset, uint8 bytes
_STATE_FORMAT = "accelkit-state"


@dataclass(frozen=True)
class TensorChange:
    """One tensor that differs between A and B.

    Attributes:
        name: where it sits (``model/0.weight``, ``optimizer/state/0.weight/exp_avg``).
        change: ``"added"`` (only in B), ``"removed"`` (only in A), ``"shape"``, ``"dtype"``
            (values also compared when the shape is the same) or ``"values"``.
        dtype_a / dtype_b: safetensors dtypes (``F32``...), ``None`` on the side without it.
        shape_a / shape_b: shapes, ``None`` on the side without it.
        max_abs: largest ``|a - b|`` (``inf`` for a NaN on one side only); ``None`` when
            the values were not compared (added, removed, shape).
        max_rel: largest ``|a - b| / |a|`` (``inf`` where ``a`` is 0 and ``b`` is not).
        changed: how many elements differ (``None`` when not compared).
    """

    name: str
    change: str
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    max_abs: float | None = None
    max_rel: float | None = None
    changed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON object (infinite differences as ``null``, with ``"infinite": true``)."""

        def finite(x: float | None) -> float | None:
            return x if x is None or math.isfinite(x) else None

        out = {
            "name": self.name,
            "change": self.change,
            "dtype": [self.dtype_a, self.dtype_b],
            "shape": [None if s is None else list(s) for s in (self.shape_a, self.shape_b)],
            "max_abs_diff": finite(self.max_abs),
            "max_rel_diff": finite(self.max_rel),
            "changed_elements": self.changed,
        }
        if any(x is not None and not math.isfinite(x) for x in (self.max_abs, self.max_rel)):
            out["infinite"] = True
        return out


@dataclass(frozen=True)
class ValueChange:
    """A value that differs: a manifest field (``checkpoint/step``), a field of an object
    state (``optimizer/param_groups/0/lr``, ``random_states_0/python``), or a whole object
    or file present on one side only. ``a``/``b`` are the values as stored (JSON), ``None``
    with ``missing`` naming the side that lacks it (``"a"`` or ``"b"``)."""

    name: str
    a: Any
    b: Any
    missing: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON object."""
        return {"name": self.name, "a": self.a, "b": self.b, "missing": self.missing}


@dataclass
class CheckpointDiff:
    """What differs between checkpoints ``a`` and ``b`` (:func:`diff_checkpoints`).

    Attributes:
        a / b: the two checkpoint paths.
        tensors: the tensors that differ, in A's order, then those only in B.
        values: the values that differ.
        tensors_compared: tensors present on both sides.
        bytes_read: bytes of tensor files read (and verified) from both sides.
    """

    a: str
    b: str
    tensors: list[TensorChange] = field(default_factory=list)
    values: list[ValueChange] = field(default_factory=list)
    tensors_compared: int = 0
    bytes_read: int = 0

    @property
    def equal(self) -> bool:
        """Whether nothing differs."""
        return not self.tensors and not self.values

    def to_json(self) -> dict[str, Any]:
        """The whole diff as one JSON object (what ``ckpt diff --json`` prints)."""
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "tensors_compared": self.tensors_compared,
            "bytes_read": self.bytes_read,
            "tensors": [t.to_json() for t in self.tensors],
            "values": [v.to_json() for v in self.values],
        }


# --------------------------------------------------------------------------- the paths


def _refusal(storage: Storage, path: str, info: CheckpointInfo) -> CheckpointError | None:
    if info.state == COMMITTED:
        if has_sharded_state(storage, path):
            return CheckpointPathError(
                f"{path} holds sharded FSDP2 state (its {SHARDED_DIRNAME}/ folder, written by "
                "DCP): ckpt diff compares plain checkpoints only. Compare the models saved "
                "with save_model, or load both and compare their full state dicts."
            )
        return None
    if info.state == ACCELERATE:
        return CheckpointPathError(
            f"{path} was written by Hugging Face accelerate's save_state; ckpt diff compares "
            "accelkit checkpoints. Convert it first with `accelkit ckpt import "
            f"{path}`, then diff the imported folder."
        )
    if info.state == INCOMPLETE:
        return CheckpointPathError(
            f"{path} has no {MANIFEST_NAME}: it is a save that did not finish, or not a "
            "checkpoint. Expected a committed checkpoint folder; `accelkit ckpt ls` on its "
            "parent lists them."
        )
    if info.state == CORRUPT:
        return CorruptCheckpointError(
            f"{path} is damaged: {info.error}. `accelkit ckpt verify {path}` tells what is "
            "wrong; compare another checkpoint."
        )
    return CheckpointPathError(
        f"{path} is {info.error}; expected a committed accelkit checkpoint folder (one "
        f"holding {MANIFEST_NAME})."
    )


def _open(storage: Storage, path: str) -> Manifest:
    """The manifest of the committed checkpoint at ``path``, or an error that says what the
    path is, what was expected and the fix."""
    expected = (
        f"expected a committed checkpoint folder (one holding {MANIFEST_NAME}, e.g. "
        "<project>/checkpoints/checkpoint_3)"
    )
    if not storage.exists(path):
        parent = path.rpartition("/")[0] or "."
        raise CheckpointPathError(
            f"{path} does not exist; {expected}. Check the path: `accelkit ckpt ls {parent}` "
            "lists the checkpoints there."
        )
    if storage.isfile(path):
        raise CheckpointPathError(f"{path} is a file; {expected}.")
    if not storage.exists(join(path, MANIFEST_NAME)):
        candidate = join(path, CHECKPOINTS_DIRNAME)
        root = candidate if storage.isdir(candidate) else path
        committed = loadable_automatic(list_checkpoints(storage, root))
        if committed:
            raise CheckpointPathError(
                f"{path} is a folder of {len(committed)} checkpoint(s), not one checkpoint; "
                f"{expected}. Pass one of them, e.g. {committed[-1].path} (the newest)."
            )
    info = inspect_folder(storage, path)
    error = _refusal(storage, path, info)
    if error is not None:
        raise error
    assert info.manifest is not None, "a committed checkpoint has a manifest"
    return info.manifest


# --------------------------------------------------------------------------- one side


@dataclass
class _Side:
    storage: Storage
    path: str
    manifest: Manifest
    entries: dict[str, FileEntry] = field(default_factory=dict)
    models: dict[str, list[str]] = field(default_factory=dict)  # stem -> files, in order
    states: dict[str, list[str]] = field(default_factory=dict)  # stem -> files
    others: list[str] = field(default_factory=list)  # files of no known kind
    bytes_read: int = 0

    @classmethod
    def open(cls, storage: Storage, path: str) -> _Side:
        manifest = _open(storage, path)
        side = cls(confine(storage, path), path, manifest, manifest.file_map())
        for name in sorted(side.entries):
            model = _MODEL_FILE.match(name)
            if model:
                side.models.setdefault(model.group(1), []).append(name)
            elif _MODEL_INDEX.match(name) or name == SAVE_MARKER_NAME:
                continue  # tensors are compared by name, wherever they are; the marker is
                # the save's own bookkeeping
            elif _STATE_FILE.match(name):
                stem = name.rsplit(".", 1)[0]
                side.states.setdefault(stem, []).append(name)
            else:
                side.others.append(name)
        return side

    def url(self, name: str) -> str:
        return join(self.path, name)

    def headers(self, files: list[str]) -> list[TensorInfo]:
        return [
            t
            for name in files
            for t in read_safetensors_header(self.storage, self.url(name)).tensors
        ]

    def pieces(self, files: list[str], buffer: Callable[[int], torch.Tensor]) -> Iterator[_Piece]:
        """Every tensor of ``files`` in pieces of at most :data:`_PIECE` bytes read into
        ``buffer(nbytes)`` (``SafetensorsStream.pieces``), each file verified once read
        whole."""
        for name in files:
            with SafetensorsStream(self.storage, self.url(name), self.entries[name]) as stream:
                yield from stream.pieces(_PIECE, buffer)
            self.bytes_read += self.entries[name].size

    def structure(self, stem: str) -> Any:
        name = stem + STRUCTURE_SUFFIX
        url = self.url(name)
        doc = load_json(read_verified_bytes(self.storage, url, self.entries.get(name)), url)
        if not isinstance(doc, dict) or doc.get("format") != _STATE_FORMAT or "state" not in doc:
            raise CorruptCheckpointError(
                f"{url}: not an accelkit state file. The checkpoint is damaged: `accelkit ckpt "
                "verify` checks it."
            )
        return doc["state"]


# --------------------------------------------------------------------------- tensors


@functools.cache
def _memcmp() -> Any:
    """libc's ``memcmp`` (``None`` where there is no C library to load)."""
    name = ctypes.util.find_library("c") or ("msvcrt" if sys.platform == "win32" else None)
    try:
        memcmp = ctypes.CDLL(name).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors of one dtype and shape hold the same bytes (a NaN
    equals itself): ``memcmp``, several times faster than any torch comparison, which
    allocates a result per element."""
    nbytes = a.numel() * a.element_size()
    memcmp = _memcmp()
    if memcmp is not None:
        return nbytes == 0 or memcmp(a.data_ptr(), b.data_ptr(), nbytes) == 0
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _exact_stats(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
    """``(max_abs, max_rel, elements that differ)`` of two float64 chunks, every rule of the
    module docstring spelled out elementwise (the path for chunks holding a NaN, or the same
    infinity on both sides, where ``|x - y|`` alone is NaN)."""
    same = (x == y) | (x.isnan() & y.isnan())
    d = (x - y).abs_().nan_to_num_(nan=math.inf, posinf=math.inf).masked_fill_(same, 0.0)
    rel = (d / x.abs()).nan_to_num_(nan=math.inf, posinf=math.inf).masked_fill_(same, 0.0)
    return float(d.max()), float(rel.max()), int((~same).sum())


def _compare_values(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int] | None:
    """``(max_abs, max_rel, elements that differ)``, or ``None`` when ``a`` equals ``b``
    (same dtype and bytes: a NaN equals itself).

    Tensors that differ are compared in float64 chunks of :data:`_CHUNK` elements, in three
    work buffers allocated once (no temporary per operation, none larger than a chunk). A
    chunk with no NaN in ``|x - y|`` (no NaN on either side, no infinity equal on both) takes
    the short way: there ``|x - y|`` is already 0 exactly where ``x == y``, so it gives
    ``max_abs`` and the count at once, and ``|x - y| / |x|`` is NaN only for 0/0 (an equal
    zero: 0) while ``max_abs`` is finite, and is infinite somewhere when ``max_abs`` is
    (``|x|`` finite: inf; infinite: inf/inf, NaN, which counts as inf). Other chunks go
    through :func:`_exact_stats`; both give the same figures.
    """
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if a.dtype == b.dtype and _same_bytes(flat_a, flat_b):
        return None
    total = flat_a.numel()
    size = min(total, _CHUNK)
    work = [torch.empty(size, dtype=torch.float64) for _ in range(3)]
    max_abs = max_rel = 0.0
    changed = 0
    for start in range(0, total, _CHUNK):
        n = min(_CHUNK, total - start)
        x, y, d = (w[:n] for w in work)
        x.copy_(flat_a[start : start + n])
        y.copy_(flat_b[start : start + n])
        torch.sub(x, y, out=d).abs_()
        top = float(d.max())
        if math.isnan(top):
            chunk_abs, chunk_rel, count = _exact_stats(x, y)
        else:
            count = int(torch.count_nonzero(d))
            if not count:
                continue
            chunk_abs = top
            if math.isinf(top) or max_rel == math.inf:
                chunk_rel = math.inf if math.isinf(top) else max_rel
            else:
                d.div_(x.abs_()).nan_to_num_(nan=0.0, posinf=math.inf)
                chunk_rel = float(d.max())
        changed += count
        max_abs = max(max_abs, chunk_abs)
        max_rel = max(max_rel, chunk_rel)
    return (max_abs, max_rel, changed) if changed else None


class _Stopped(AccelkitError):
    """Raised in a reader thread whose consumer has stopped (:meth:`_Reader.close`); caught in
    that thread, never seen outside it."""


_END = object()  # a reader's last item: every file read and verified


class _Slot:
    """One reusable read buffer of a :class:`_Reader`, grown to the largest piece it held."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.data.numel() < nbytes:
            self.data = torch.empty(0, dtype=torch.uint8)  # the old one freed first
            self.data = torch.empty(nbytes, dtype=torch.uint8)
        return self.data[:nbytes]


class _Reader:
    """The pieces of one side's ``files`` (:meth:`_Side.pieces`), read and verified by a
    thread of its own up to :data:`_READ_AHEAD` pieces ahead of the consumer, into at most
    ``1 + _READ_AHEAD`` reused buffers.

    Iterate it (once) for ``(info, dtype, offset, piece)`` in data order; a piece stays valid
    until the next one is asked for (its buffer goes back to the thread then): keep one longer
    only as a copy. An error of the reads (a damaged or missing file) is raised where the plain
    stream would have raised it: after the pieces read before it. :meth:`close` stops the
    thread (a consumer that failed or stopped early) and waits for it.
    """

    def __init__(self, side: _Side, files: list[str]) -> None:
        self._free: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        for _ in range(1 + _READ_AHEAD):
            self._free.put(_Slot())
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._filling: _Slot | None = None
        self._thread = threading.Thread(
            target=self._run, args=(side, files), name=f"accelkit-diff-read {side.path}"
        )
        self._thread.daemon = True
        self._thread.start()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        slot = self._free.get()
        if slot is None or self._stop.is_set():
            raise _Stopped
        self._filling = slot
        return slot.take(nbytes)

    def _run(self, side: _Side, files: list[str]) -> None:
        try:
            for piece in side.pieces(files, self._buffer):
                slot, self._filling = self._filling, None  # None: an empty tensor's piece
                self._ready.put((piece, slot))
            self._ready.put(_END)
        except _Stopped:
            pass
        except BaseException as exc:  # handed to the consumer, raised there
            self._ready.put(exc)

    def __iter__(self) -> Iterator[_Piece]:
        while True:
            item = self._ready.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            piece, slot = item
            try:
                yield piece
            finally:
                if slot is not None:
                    self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        self._free.put(None)  # wakes the thread if it waits for a buffer
        self._thread.join()


def _last(piece: _Piece) -> bool:
    """Whether ``piece`` ends its tensor."""
    info, _, offset, data = piece
    start, end = info.data_offsets
    return offset + data.numel() == end - start


def _whole(first: _Piece, pieces: Iterator[_Piece]) -> torch.Tensor:
    """The tensor ``first`` starts, its pieces copied out of the reader's buffers."""
    info, dtype, _, _ = first
    start, end = info.data_offsets
    whole = torch.empty(end - start, dtype=torch.uint8)
    piece = first
    while True:
        offset, data = piece[2], piece[3]
        whole[offset : offset + data.numel()].copy_(data)
        if _last(piece):
            return whole.view(dtype).reshape(info.shape)
        piece = next(pieces)


def _skip(first: _Piece, pieces: Iterator[_Piece]) -> None:
    """Read past the tensor ``first`` starts."""
    piece = first
    while not _last(piece):
        piece = next(pieces)


def _merge(
    found: tuple[float, float, int] | None, more: tuple[float, float, int] | None
) -> tuple[float, float, int] | None:
    """The figures of two parts of a tensor taken together."""
    if found is None or more is None:
        return found or more
    return max(found[0], more[0]), max(found[1], more[1]), found[2] + more[2]


def _compare_in_step(
    first_a: _Piece, first_b: _Piece, pieces_a: Iterator[_Piece], pieces_b: Iterator[_Piece]
) -> tuple[float, float, int] | None:
    """:func:`_compare_values` of two tensors of one dtype and shape, piece by piece as both
    readers hand them over (their pieces have the same sizes)."""
    piece_a, piece_b = first_a, first_b
    dtype = piece_a[1]
    found = None
    while True:
        more = _compare_values(piece_a[3].view(dtype), piece_b[3].view(dtype))
        found = _merge(found, more)
        if _last(piece_a):
            return found
        piece_a, piece_b = next(pieces_a), next(pieces_b)


def _diff_tensors(
    name_of_a: Callable[[str], str],
    name_of_b: Callable[[str], str],
    a: _Side,
    b: _Side,
    files_a: list[str],
    files_b: list[str],
    out: CheckpointDiff,
) -> None:
    """Compare the tensors of ``files_a`` with those of ``files_b``, matched by the names
    ``name_of_a``/``name_of_b`` give their keys."""
    infos_a = {name_of_a(t.name): t for t in a.headers(files_a)}
    infos_b = {name_of_b(t.name): t for t in b.headers(files_b)}
    compare: set[str] = set()
    for name, ta in infos_a.items():
        tb = infos_b.get(name)
        if tb is None:
            out.tensors.append(TensorChange(name, REMOVED, ta.dtype, None, ta.shape, None))
        elif ta.shape != tb.shape:
            out.tensors.append(TensorChange(name, SHAPE, ta.dtype, tb.dtype, ta.shape, tb.shape))
        else:
            compare.add(name)
    out.tensors_compared += len(infos_a.keys() & infos_b.keys())
    added = [
        TensorChange(name, ADDED, None, tb.dtype, None, tb.shape)
        for name, tb in infos_b.items()
        if name not in infos_a
    ]
    if not compare:  # nothing to read (an object on one side only, or every shape changed)
        out.tensors += added
        return
    # Stream A; pull B forward to each twin, keeping (copied) only B's tensors read before
    # theirs. Each side is read by a thread of its own, ahead of the comparison; twins stored
    # in the same order and dtype are compared piece by piece as they arrive.
    ahead: dict[str, torch.Tensor] = {}
    reader_a = _Reader(a, files_a)
    try:
        reader_b = _Reader(b, files_b)
        try:
            pieces_a, pieces_b = iter(reader_a), iter(reader_b)
            for first in pieces_a:  # the first piece of each tensor of A
                info = first[0]
                name = name_of_a(info.name)
                if name not in compare:
                    _skip(first, pieces_a)
                    continue
                twin = ahead.pop(name, None)
                if twin is not None:
                    found = _compare_values(_whole(first, pieces_a), twin)
                else:
                    while True:
                        first_b = next(pieces_b)
                        name_b = name_of_b(first_b[0].name)
                        if name_b == name:
                            break
                        if name_b in compare:
                            ahead[name_b] = _whole(first_b, pieces_b)
                        else:
                            _skip(first_b, pieces_b)
                    if first[1] == first_b[1]:
                        found = _compare_in_step(first, first_b, pieces_a, pieces_b)
                    else:  # another dtype: compared whole
                        whole_a = _whole(first, pieces_a)
                        found = _compare_values(whole_a, _whole(first_b, pieces_b))
                _record(name, info, infos_b[name], found, out)
            for _ in pieces_b:  # the rest of B: read, so that its checksums are checked too
                pass
        finally:
            reader_b.close()
    finally:
        reader_a.close()
    out.tensors += added


def _record(
    name: str,
    ia: TensorInfo,
    ib: TensorInfo,
    found: tuple[float, float, int] | None,
    out: CheckpointDiff,
) -> None:
    """Add the change of a tensor on both sides (``found``: :func:`_compare_values`)."""
    if ia.dtype != ib.dtype:
        m = found or (0.0, 0.0, 0)
        out.tensors.append(TensorChange(name, DTYPE, ia.dtype, ib.dtype, ia.shape, ib.shape, *m))
    elif found is not None:
        out.tensors.append(
            TensorChange(name, VALUES, ia.dtype, ib.dtype, ia.shape, ib.shape, *found)
        )


def _namer(stem: str, names: dict[str, str] | None = None) -> Callable[[str], str]:
    """Tensor key -> shown name: ``names[key]`` (an object state's tensors, named by their
    place in it), else ``<stem>/<key>`` (a model's weights: ``model/0.weight``)."""
    found = names or {}
    return lambda key: found.get(key, f"{stem}/{key}")


# --------------------------------------------------------------------------- structures


_SCALARS = (str, int, float, bool, type(None))


def _plain(node: Any) -> Any:
    """A structure node with accelkit's tags undone where they only shape containers."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "__tuple__" and isinstance(value, list):
            return value
        if tag == "__dict__" and isinstance(value, list):
            return {key_text(p[0]): p[1] for p in value if isinstance(p, list) and len(p) == 2}
    return node


def _is_tensor(node: Any) -> bool:
    return (
        isinstance(node, dict)
        and len(node) <= 2
        and ("__tensor__" in node or "__ndarray__" in node)
    )


def _diff_tree(
    a: Any, b: Any, path: tuple[str, ...], stem: str, names: dict[str, str], out: list[ValueChange]
) -> None:
    """Record every value that differs between two structure trees (tensors are compared
    apart; a list of plain values, a generator's state, is one value)."""
    a, b = _plain(a), _plain(b)
    shown = "/".join((stem, *named_path(path, names)))
    if _is_tensor(a) and _is_tensor(b):
        return
    if isinstance(a, dict) and isinstance(b, dict) and not _is_tensor(a) and not _is_tensor(b):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in b:
                out.append(ValueChange(f"{shown}/{key}", a[key], None, "b"))
            elif key not in a:
                out.append(ValueChange(f"{shown}/{key}", None, b[key], "a"))
            else:
                _diff_tree(a[key], b[key], (*path, key), stem, names, out)
        return
    if (
        isinstance(a, list)
        and isinstance(b, list)
        and len(a) == len(b)
        and not all(isinstance(v, _SCALARS) for v in [*a, *b])
    ):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff_tree(x, y, (*path, str(index)), stem, names, out)
        return
    if a != b or type(a) is not type(b):
        out.append(ValueChange(shown, a, b))


def _diff_state(a: _Side, b: _Side, stem: str, out: CheckpointDiff) -> None:
    tree_a, tree_b = a.structure(stem), b.structure(stem)
    names = parameter_names(tree_a) or parameter_names(tree_b)
    _diff_tree(tree_a, tree_b, (), stem, names, out.values)
    tensors = stem + TENSORS_SUFFIX
    files_a = [tensors] if tensors in a.entries else []
    files_b = [tensors] if tensors in b.entries else []
    _diff_tensors(
        _namer(stem, name_state_tensors(tree_a, stem)),
        _namer(stem, name_state_tensors(tree_b, stem)),
        a,
        b,
        files_a,
        files_b,
        out,
    )
    extras = stem + TORCH_SUFFIX  # values only torch.save could hold: compared as files
    _diff_file(a, b, extras, out)


def _diff_file(a: _Side, b: _Side, name: str, out: CheckpointDiff) -> None:
    ea, eb = a.entries.get(name), b.entries.get(name)
    if ea is None and eb is None:
        return
    if ea is None or eb is None:
        side = "a" if ea is None else "b"
        out.values.append(ValueChange(f"file {name}", ea and ea.checksum, eb and eb.checksum, side))
    elif (ea.size, ea.checksum) != (eb.size, eb.checksum):
        out.values.append(ValueChange(f"file {name}", ea.checksum, eb.checksum))


# --------------------------------------------------------------------------- the diff


_MANIFEST_FIELDS = ("iteration", "step", "world_size", "metadata", "metrics")


def diff_checkpoints(
    storage_a: Storage, path_a: str, storage_b: Storage, path_b: str
) -> CheckpointDiff:
    """Compare the committed checkpoints at ``path_a`` and ``path_b`` (see the module
    docstring for what is compared and how).

    Args:
        storage_a / storage_b: the storages of the two paths (a local disk, any fsspec URL).
        path_a / path_b: two checkpoint folders (each holding ``accelkit.json``).

    Returns:
        The :class:`CheckpointDiff`; ``diff.equal`` is whether nothing differs.

    Raises:
        CheckpointPathError: a path that does not exist, is a file, a folder of checkpoints,
            an incomplete save, Hugging Face accelerate's folder or holds sharded (FSDP2)
            state; the message says what was expected and the fix.
        CorruptCheckpointError: a damaged checkpoint (a file missing, truncated, or whose
            checksum disagrees with the manifest), naming the file.
    """
    a = _Side.open(storage_a, path_a.rstrip("/") or path_a)
    b = _Side.open(storage_b, path_b.rstrip("/") or path_b)
    out = CheckpointDiff(a.path, b.path)
    for key in _MANIFEST_FIELDS:
        va, vb = getattr(a.manifest, key), getattr(b.manifest, key)
        if va != vb:
            out.values.append(ValueChange(f"checkpoint/{key}", va, vb))
    for stem in [*a.models, *(s for s in b.models if s not in a.models)]:
        name = _namer(stem)
        _diff_tensors(name, name, a, b, a.models.get(stem, []), b.models.get(stem, []), out)
    for stem in [*a.states, *(s for s in b.states if s not in a.states)]:
        if stem in a.states and stem in b.states:
            _diff_state(a, b, stem, out)
            continue
        side, present = ("b", a) if stem in a.states else ("a", b)
        out.values.append(
            ValueChange(stem, stem if side == "b" else None, stem if side == "a" else None, side)
        )
        tensors = stem + TENSORS_SUFFIX
        if tensors in present.entries:  # each tensor added or removed, from the header alone
            name = _namer(stem, name_state_tensors(present.structure(stem), stem))
            files = [tensors]
            if side == "b":
                _diff_tensors(name, name, a, b, files, [], out)
            else:
                _diff_tensors(name, name, a, b, [], files, out)
    for other in [*a.others, *(n for n in b.others if n not in a.others)]:
        _diff_file(a, b, other, out)
    out.bytes_read = a.bytes_read + b.bytes_read
    return out
