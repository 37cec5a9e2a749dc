"""Where each tensor of a DCP checkpoint lies: its chunks, their files and byte ranges.

``torch.distributed.checkpoint`` (DCP, file-system storage, this torch) writes each process's
part of a tensor, a *chunk* (a box of the global tensor: ``offsets`` and ``sizes`` per
dimension), as one ``torch.save`` archive of that chunk, at ``offset`` for ``length`` bytes of
the file ``relative_path`` (``__<rank>_0.distcp``); the ``.metadata`` index
(:mod:`~accelkit.checkpointing.formats.dcp_metadata`, read with an allow-list) maps each
``(name, chunk offsets)`` to that ``_StorageInfo``. This module reads that index as a plan,
with no process group and no DCP planner:

- :func:`plan_tensors`: every tensor under a key prefix (``model.``) as a :class:`TensorPlan`
  (dtype, global shape, its :class:`ChunkRead` s), checked before a byte of data is read:
  each chunk has its storage entry, its byte range lies inside its file (as large as it is on
  the storage now), no two byte ranges of a file overlap, and the chunks tile the global shape
  (inside it, no two overlapping, none missing). Stream transforms (DCP's extensions) are
  refused by name: the export reads plain ``torch.save`` chunks only.
- :func:`load_chunk`: one chunk's bytes (exactly its range) as a tensor, through the checked
  ``torch.save`` reader (:mod:`~accelkit.checkpointing.formats._torch_pickle`: zip structure and
  pickle scanned as data first) and then ``torch.load(weights_only=True)``; its dtype and shape
  must be the ones the index gives.
- :func:`chunk_runs`: where a chunk's elements go in the row-major global tensor, as runs of
  contiguous elements (one run for FSDP2's shards along dimension 0).

Every refusal is a :class:`~accelkit.checkpointing.errors.CorruptCheckpointError` naming the
file and the tensor.

Public API: :class:`ChunkRead`, :class:`TensorPlan`, :func:`plan_tensors`, :func:`load_chunk`,
:func:`chunk_runs`.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError

__all__ = ["ChunkRead", "TensorPlan", "chunk_runs", "load_chunk", "plan_tensors"]


@dataclass(frozen=True)
class ChunkRead:
    """One chunk of a tensor and where its ``torch.save`` bytes are.

    Attributes:
        offsets: the chunk's first index in each dimension of the global tensor.
        sizes: the chunk's extent in each dimension.
        file: the file holding it, relative to the sharded folder (``__0_0.distcp``).
        start: its first byte in ``file``.
        length: its byte count.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the sharded state: its stored name, dtype, global shape and chunks.

    Attributes:
        name: its key in the DCP state dict (``model.embed.weight``).
        dtype: the stored dtype.
        shape: the global shape.
        chunks: its chunks, in the index's order.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkRead, ...]


def _corrupt(url: str, name: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: tensor {name!r}: {why}. The sharded state is damaged or crafted; nothing was "
        "exported. Export an earlier checkpoint (`accelkit ckpt verify` checks them)."
    )


def _storage_index(metadata: Any, url: str) -> dict[tuple[str, tuple[int, ...]], Any]:
    out: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in metadata.storage_data.items():
        offset = getattr(index, "offset", None)
        key = tuple(offset) if offset is not None else ()
        if not all(type(v) is int for v in key):
            raise _corrupt(url, index.fqn, f"its storage entry has offsets {offset!r:.80}")
        out[(index.fqn, key)] = info
    return out


def _overlap(a: ChunkRead, b: ChunkRead) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def _check_tiling(url: str, name: str, shape: tuple[int, ...], chunks: list[ChunkRead]) -> None:
    for chunk in chunks:
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
            raise _corrupt(
                url,
                name,
                f"chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} lies outside the "
                f"tensor's shape {list(shape)}",
            )
    boxes = [c for c in chunks if math.prod(c.sizes)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if _overlap(a, b):
                raise _corrupt(
                    url,
                    name,
                    f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap (sizes "
                    f"{list(a.sizes)} and {list(b.sizes)})",
                )
    covered = sum(math.prod(c.sizes) for c in boxes)
    if covered != math.prod(shape):
        raise _corrupt(
            url,
            name,
            f"its chunks cover {covered} of its {math.prod(shape)} elements (shape "
            f"{list(shape)}): a chunk is missing",
        )


def plan_tensors(
    metadata: Any, url: str, prefix: str, file_sizes: Mapping[str, int]
) -> list[TensorPlan]:
    """Every tensor whose key starts with ``prefix`` (``"model."``), checked, in key order.

    Args:
        metadata: DCP's ``Metadata``, from
            :func:`~accelkit.checkpointing.formats.dcp_metadata.read_sharded_metadata` (its
            fields' types already checked).
        url: the sharded folder, for messages.
        prefix: the key prefix of the tensors wanted.
        file_sizes: the size of every file of the sharded folder (relative name -> bytes), as
            it is on the storage.

    Raises:
        CorruptCheckpointError: naming the file and the tensor: a chunk without its storage
            entry, a byte range outside its file (or a file that is absent), two byte ranges of
            one file that overlap, chunks that do not tile the tensor's shape.
        CheckpointError: a chunk written through DCP's stream transforms (compression...),
            which the export does not read.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = _storage_index(metadata, url)
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        ranges.setdefault(info.relative_path, []).append(
            (info.offset, info.offset + info.length, index.fqn)
        )
    for file, spans in ranges.items():
        spans.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end:
                raise _corrupt(
                    f"{url}/{file}",
                    second,
                    f"its bytes (from {start}) overlap those of {first!r} (up to {end})",
                )
    plans = []
    for name, item in sorted(metadata.state_dict_metadata.items()):
        if not name.startswith(prefix) or not isinstance(item, TensorStorageMetadata):
            continue
        shape = tuple(item.size)
        chunks = []
        for chunk in item.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            info = where.get((name, offsets))
            if info is None:
                raise _corrupt(
                    url, name, f"its chunk at {list(offsets)} has no storage entry (no file)"
                )
            file = info.relative_path
            if info.transform_descriptors:
                raise CheckpointError(
                    f"{url}/{file}: tensor {name!r} was written through DCP stream transforms "
                    f"{list(info.transform_descriptors)}, which the export does not read. Load "
                    "the checkpoint into the model and call accelerator.save_model(model, OUT)."
                )
            size = file_sizes.get(file)
            if size is None:
                raise _corrupt(f"{url}/{file}", name, "its file is missing")
            if info.offset + info.length > size:
                raise _corrupt(
                    f"{url}/{file}",
                    name,
                    f"its chunk at {list(offsets)} is stored at bytes {info.offset}.."
                    f"{info.offset + info.length}, past the file's end ({size} bytes): the "
                    "file is truncated",
                )
            chunks.append(ChunkRead(offsets, sizes, file, info.offset, info.length))
        _check_tiling(url, name, shape, chunks)
        plans.append(TensorPlan(name, item.properties.dtype, shape, tuple(chunks)))
    return plans


def load_chunk(
    data: bytes | bytearray | memoryview, url: str, name: str, chunk: ChunkRead, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor stored in ``data`` (exactly ``chunk``'s byte range of file ``url``).

    The archive is checked as data first (zip structure, pickle scanned on stand-ins), then
    read with ``torch.load(weights_only=True)``.

    Raises:
        CorruptCheckpointError: naming ``url`` and ``name``: not a ``torch.save`` archive of one
            tensor, or one of another dtype or shape than the index gives.
    """
    from accelkit.checkpointing.formats._torch_pickle import read_archive, scan_pickle, torch_rules

    stream = io.BytesIO(data)
    try:
        scan_pickle(read_archive(stream, url), url, torch_rules())
        stream.seek(0)
        value = torch.load(stream, map_location="cpu", weights_only=True)
    except CorruptCheckpointError as exc:
        raise _corrupt(
            url, name, f"its chunk at {list(chunk.offsets)} is unreadable ({exc})"
        ) from None
    except Exception as exc:  # torch.load's refusals are not one type
        raise _corrupt(
            url,
            name,
            f"torch.load(weights_only=True) refused its chunk at {list(chunk.offsets)} "
            f"({type(exc).__name__}: {str(exc)[:200]})",
        ) from None
    if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
        raise _corrupt(url, name, f"its chunk holds a {type(value).__name__}, not a tensor")
    if value.dtype != dtype or tuple(value.shape) != chunk.sizes:
        raise _corrupt(
            url,
            name,
            f"its chunk at {list(chunk.offsets)} is {value.dtype} of shape "
            f"{list(value.shape)}; the index says {dtype} of shape {list(chunk.sizes)}",
        )
    return value


def chunk_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> Iterator[tuple[int, int, int]]:
    """``(first element in the global tensor, first element in the chunk, count)`` of each
    run of contiguous elements of the chunk, both row-major, in order.

    The chunk's trailing dimensions that span the whole tensor merge into one run with the
    last partial dimension: a chunk along dimension 0 is a single run.
    """
    if not shape:
        yield 0, 0, 1
        return
    if not math.prod(sizes):
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    split = len(shape) - 1  # the last dimension the run cannot extend past
    while split > 0 and sizes[split] == shape[split]:
        split -= 1
    run = math.prod(sizes[split:])
    base = offsets[split] * strides[split]
    lead = [range(s) for s in sizes[:split]]
    position = 0
    for index in itertools.product(*lead):
        start = base + sum((offsets[d] + i) * strides[d] for d, i in enumerate(index))
        yield start, position, run
        position += run
