"""``formats/dcp_chunks.py``: DCP's index read as a plan of chunks, one chunk read from its bytes.

The real FSDP2 checkpoint (chunks along dimension 0 only) is exported in
``tests/distributed/test_fsdp_export.py``. Here, in one process, a DCP layout as DCP's
file-system writer lays it out (each chunk a ``torch.save`` archive at an offset of a file,
the index a ``Metadata`` of torch's own classes) with chunks along every dimension: a 2x2 grid
of a matrix, a 3-D tensor cut along its last dimension, a 0-d tensor; and the refusals.
"""

from __future__ import annotations

import io
import itertools
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.dcp_chunks import chunk_runs, load_chunk, plan_tensors


def _boxes(shape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], ...]]:
    """Every box of the grid cutting dimension d at ``cuts[d]``: (offsets, sizes)."""
    spans = [list(itertools.pairwise([0, *c, n])) for n, c in zip(shape, cuts)]
    return [
        (tuple(a for a, _ in box), tuple(b - a for a, b in box))
        for box in itertools.product(*spans)
    ]


def _layout(
    tensors: dict[str, tuple[torch.Tensor, list[list[int]]]],
) -> tuple[Any, dict[str, bytes]]:
    """A DCP index and its two files, the chunks dealt to them in turn."""
    files: dict[str, io.BytesIO] = {"__0_0.distcp": io.BytesIO(), "__1_0.distcp": io.BytesIO()}
    names = list(files)
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    turn = 0
    for name, (value, cuts) in tensors.items():
        chunks = []
        for offsets, sizes in _boxes(tuple(value.shape), cuts):
            part = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
            file = names[turn % 2]
            turn += 1
            start = files[file].tell()
            torch.save(part, files[file])
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(name, offsets)] = _StorageInfo(
                file, start, files[file].tell() - start
            )
        state[name] = TensorStorageMetadata(
            TensorProperties(dtype=value.dtype), torch.Size(value.shape), chunks
        )
    return Metadata(state, storage_data=storage), {k: v.getvalue() for k, v in files.items()}


def _assemble(
    metadata: Any, files: dict[str, bytes], prefix: str = "model."
) -> dict[str, torch.Tensor]:
    sizes = {k: len(v) for k, v in files.items()}
    out = {}
    for plan in plan_tensors(metadata, "ckpt/sharded", prefix, sizes):
        full = torch.full(plan.shape, -1, dtype=plan.dtype).reshape(-1)
        for chunk in plan.chunks:
            data = files[chunk.file][chunk.start : chunk.start + chunk.length]
            flat = load_chunk(data, chunk.file, plan.name, chunk, plan.dtype).reshape(-1)
            for out_first, first, count in chunk_runs(plan.shape, chunk.offsets, chunk.sizes):
                full[out_first : out_first + count] = flat[first : first + count]
        out[plan.name] = full.reshape(plan.shape)
    return out


def _tensors() -> dict[str, tuple[torch.Tensor, list[list[int]]]]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.grid": (torch.randn(5, 7, generator=gen), [[2], [3]]),
        "model.last_dim": (torch.arange(2 * 3 * 8).reshape(2, 3, 8), [[], [], [1, 5]]),
        "model.rows": (torch.randn(9, 4, generator=gen).double(), [[5], []]),
        "model.scalar": (torch.tensor(3.5), []),
        "optimizer.state": (torch.randn(4, generator=gen), [[2]]),
    }


def test_chunks_along_any_dimension_reassemble_the_tensor() -> None:
    tensors = _tensors()
    metadata, files = _layout(tensors)
    rebuilt = _assemble(metadata, files)
    assert sorted(rebuilt) == ["model.grid", "model.last_dim", "model.rows", "model.scalar"]
    for name, value in rebuilt.items():
        assert value.dtype == tensors[name][0].dtype and torch.equal(value, tensors[name][0])


def test_chunk_runs_are_the_chunks_elements_in_row_major_order() -> None:
    shape = (4, 6, 5)
    index = torch.arange(4 * 6 * 5).reshape(shape)
    for offsets, sizes in [((1, 2, 0), (2, 3, 5)), ((0, 0, 0), (4, 6, 5)), ((3, 0, 1), (1, 6, 2))]:
        box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        got = torch.cat(
            [torch.arange(s, s + n) for s, first, n in chunk_runs(shape, offsets, sizes)]
        )
        assert torch.equal(got, box), (offsets, sizes)
    # A chunk along dimension 0 (FSDP2's) is one run.
    assert list(chunk_runs((9, 4), (5, 0), (4, 4))) == [(20, 0, 16)]


def _refused(metadata: Any, files: dict[str, bytes], *match: str) -> None:
    with pytest.raises(CorruptCheckpointError) as info:
        _assemble(metadata, files)
    for text in match:
        assert text in str(info.value), str(info.value)


def test_refusals_name_the_file_and_the_tensor() -> None:
    tensors = _tensors()
    # A chunk missing from the index: its tensor is not tiled.
    metadata, files = _layout(tensors)
    metadata.state_dict_metadata["model.grid"].chunks.pop()
    _refused(metadata, files, "'model.grid'", "a chunk is missing")
    # Two chunks claiming the same elements.
    metadata, files = _layout(tensors)
    chunks = metadata.state_dict_metadata["model.rows"].chunks
    chunks.append(ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([2, 4])))
    metadata.storage_data[MetadataIndex("model.rows", [4, 0])] = _StorageInfo(
        "__1_0.distcp", len(files["__1_0.distcp"]), 0
    )
    _refused(metadata, files, "'model.rows'", "overlap")
    # A chunk reaching outside the tensor's shape.
    metadata, files = _layout(tensors)
    metadata.state_dict_metadata["model.rows"].size = torch.Size([8, 4])
    _refused(metadata, files, "'model.rows'", "outside the tensor's shape")
    # Byte ranges: past the end of the (truncated) file, overlapping another.
    metadata, files = _layout(tensors)
    end = max(
        i.offset + i.length
        for k, i in metadata.storage_data.items()
        if k.fqn.startswith("model.") and i.relative_path == "__1_0.distcp"
    )
    files["__1_0.distcp"] = files["__1_0.distcp"][: end - 1]
    _refused(metadata, files, "__1_0.distcp", "tensor 'model.", "past the file's end")
    metadata, files = _layout(tensors)
    for info in metadata.storage_data.values():
        if info.relative_path == "__0_0.distcp" and info.offset:
            info.offset -= 1
            break
    _refused(metadata, files, "__0_0.distcp", "overlap")
    # A chunk whose bytes hold another shape, or something that is not a tensor.
    metadata, files = _layout(tensors)
    metadata.state_dict_metadata["model.scalar"].properties = TensorProperties(dtype=torch.int64)
    _refused(metadata, files, "'model.scalar'", "the index says torch.int64")
    metadata, files = _layout(tensors)
    (key,) = [k for k in metadata.storage_data if k.fqn == "model.scalar"]
    info = metadata.storage_data[key]
    buffer = io.BytesIO()
    torch.save({"not": "a tensor"}, buffer)
    data = bytearray(files[info.relative_path])
    files[info.relative_path] = bytes(data) + buffer.getvalue()
    metadata.storage_data[key] = _StorageInfo(info.relative_path, len(data), len(buffer.getvalue()))
    _refused(metadata, files, "'model.scalar'", "not a tensor")
