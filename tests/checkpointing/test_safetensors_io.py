"""Streamed safetensors files: readable by the safetensors library, checked when read back."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.manifest import FileEntry
from accelkit.checkpointing.formats.safetensors_header import MAX_HEADER_BYTES, read_header
from accelkit.checkpointing.formats.safetensors_io import (
    SafetensorsStream,
    parse_size,
    read_safetensors,
    write_safetensors,
)
from accelkit.checkpointing.storage import get_storage
from accelkit.checkpointing.storage.checksum import checksum_bytes
from tests.checkpointing.conftest import Root


def _tensors() -> dict[str, torch.Tensor]:
    base = torch.randn(6, 4)
    return {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "f16": torch.randn(2, 2, dtype=torch.float16),
        "i64": torch.arange(9),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # not contiguous
        "slice": base[1:3],  # a view into a bigger storage
    }


def test_written_file_is_standard_safetensors(tmp_path: Any) -> None:
    storage = get_storage(str(tmp_path))
    url = str(tmp_path / "a.safetensors")
    tensors = _tensors()
    written = write_safetensors(storage, url, tensors, {"format": "pt"})
    data = (tmp_path / "a.safetensors").read_bytes()
    assert written.size == len(data) and written.checksum == checksum_bytes(data)
    loaded = load_file(url)  # the reference implementation reads it
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    assert json.loads(data[8 : 8 + length])["__metadata__"] == {"format": "pt"}


def test_reads_files_of_the_reference_writer_and_verifies(root: Root) -> None:
    tensors = _tensors()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    url = f"{root.url}/ref.safetensors"
    written = write_safetensors(root.storage, url, tensors)
    entry = FileEntry("ref.safetensors", written.size, written.checksum)
    back, meta = read_safetensors(root.storage, url, entry)
    assert meta == {}
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    back[next(iter(back))].add_(1)  # loaded tensors are writable


def test_reference_files_load(tmp_path: Any) -> None:
    path = str(tmp_path / "r.safetensors")
    save_file({"w": torch.randn(3, 3), "b": torch.zeros(3)}, path, metadata={"k": "v"})
    back, meta = read_safetensors(get_storage(path), path)
    assert torch.equal(back["w"], load_file(path)["w"]) and meta == {"k": "v"}


def _entry_for(path: Any) -> FileEntry:
    data = path.read_bytes()
    return FileEntry(path.name, len(data), checksum_bytes(data))


def test_damaged_files_are_refused_naming_the_file(tmp_path: Any) -> None:
    storage = get_storage(str(tmp_path))
    path = tmp_path / "m.safetensors"
    write_safetensors(storage, str(path), {"w": torch.ones(1000)})
    entry = _entry_for(path)
    data = bytearray(path.read_bytes())

    data[-10] ^= 0xFF  # one flipped byte in the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"m\.safetensors: checksum .*verify=False"):
        read_safetensors(storage, str(path), entry)
    read_safetensors(storage, str(path))  # without a manifest entry nothing can tell

    path.write_bytes(bytes(data[:-100]))  # truncated
    with pytest.raises(CorruptCheckpointError, match=r"m\.safetensors.*(end of file|past the end)"):
        read_safetensors(storage, str(path))
    with pytest.raises(CorruptCheckpointError, match=r"m\.safetensors"):
        read_safetensors(storage, str(path), entry)

    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_safetensors(storage, str(tmp_path / "nope.safetensors"))


def _raw_file(path: Any, header: dict[str, Any], payload: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + payload)


@pytest.mark.parametrize(
    ("header", "length", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 2**40, "header length"),
        ({"a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}, None, "past"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            None,
            "overlaps",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, None, "needs 12 bytes"),
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, None, "safetensors dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, None, "field 'shape'"),
        ({"a": [1, 2]}, None, "not an object"),
    ],
)
def test_hostile_headers_are_refused(
    tmp_path: Any, header: dict[str, Any], length: int | None, match: str
) -> None:
    path = tmp_path / "h.safetensors"
    _raw_file(path, header, b"\0" * 16, length)
    with pytest.raises(CorruptCheckpointError, match=match):
        read_safetensors(get_storage(str(path)), str(path), _entry_for(path))


def test_parse_size() -> None:
    assert parse_size("10GB") == 10 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2KiB") == 2048
    assert parse_size(123) == 123
    for bad in ("ten GB", "5XB", 0, -3, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)  # type: ignore[arg-type]


_MEMORY_PROBE = textwrap.dedent(
    """
    import sys, torch
    from tests.helpers.memory import peak_kib
    from accelkit.checkpointing.formats.safetensors_io import write_safetensors
    from accelkit.checkpointing.storage import get_storage
    tensors = {f"t{i}": torch.randn(8 * 1024 * 1024) for i in range(6)}  # 6 x 32 MiB
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    storage = get_storage(sys.argv[1])
    write_safetensors(storage, sys.argv[1] + "/warm.safetensors", {"x": torch.ones(4)})
    before = peak_kib() * 1024
    write_safetensors(storage, sys.argv[1] + "/big.safetensors", tensors)
    after = peak_kib() * 1024
    print(after - before, total)
    """
)


@pytest.mark.slow
def test_save_streams_with_little_extra_memory(tmp_path: Any) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    extra, total = int(out[0]), int(out[1])
    assert (tmp_path / "big.safetensors").stat().st_size > total
    assert extra < 0.10 * total, f"peak memory grew by {extra} bytes for a {total}-byte file"


def test_zero_copy_local_read_matches_and_handles_misalignment(tmp_path: Any) -> None:
    path = tmp_path / "odd.safetensors"
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [3, 7]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x01\x02\x03" + struct.pack("<f", 2.5))
    storage = get_storage(str(path))
    for zero_copy in (False, True):
        tensors, _ = read_safetensors(storage, str(path), _entry_for(path), zero_copy=zero_copy)
        assert tensors["a"].tolist() == [1, 2, 3] and tensors["b"].tolist() == [2.5]
    data = bytearray(path.read_bytes())
    entry = _entry_for(path)
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_safetensors(storage, str(path), entry, zero_copy=True)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_safetensors(storage, str(tmp_path / "none.safetensors"), zero_copy=True)


@pytest.mark.parametrize("length", [2**40, MAX_HEADER_BYTES + 1])
def test_every_reader_bounds_the_header_length_alike(tmp_path: Any, length: int) -> None:
    """The stream, the memory map and ``read_header`` (``ckpt inspect``) share one bound: a
    prefix just over ``MAX_HEADER_BYTES`` (once under the stream's own 100 MiB) is refused by
    all three with the same message, before anything is allocated for it."""
    path = tmp_path / "h.safetensors"
    _raw_file(path, {}, b"", length)
    if length < 2**40:  # a file big enough to hold the header: only the limit refuses it
        os.truncate(path, 8 + MAX_HEADER_BYTES + 64)  # sparse, nothing written
    storage = get_storage(str(path))
    messages = []
    for zero_copy in (False, True):
        with pytest.raises(CorruptCheckpointError, match="header length prefix") as info:
            read_safetensors(storage, str(path), zero_copy=zero_copy)
        messages.append(str(info.value))
    with path.open("rb") as f, pytest.raises(CorruptCheckpointError) as info:
        read_header(f, str(path), path.stat().st_size)
    messages.append(str(info.value))
    assert len(set(messages)) == 1, messages
    assert f"limit {MAX_HEADER_BYTES}" in messages[0]


def test_pieces_read_into_the_callers_buffer_and_verify(tmp_path: Any) -> None:
    """``SafetensorsStream.pieces``: every tensor's bytes, in pieces of at most ``size`` read
    into the buffer the caller hands out, in data order; then the checksum."""
    storage = get_storage(str(tmp_path))
    path = tmp_path / "p.safetensors"
    tensors = {k: v.contiguous() for k, v in _tensors().items()}
    write_safetensors(storage, str(path), tensors)
    entry = _entry_for(path)
    buffer = torch.empty(16, dtype=torch.uint8)
    asked: list[int] = []

    def into(nbytes: int) -> torch.Tensor:
        asked.append(nbytes)
        return buffer[:nbytes]

    got: dict[str, bytearray] = {}
    with SafetensorsStream(storage, str(path), entry) as stream:
        for info, dtype, offset, piece in stream.pieces(16, into):
            assert dtype == tensors[info.name].dtype
            data = got.setdefault(info.name, bytearray())
            assert offset == len(data) and piece.numel() <= 16
            assert piece.numel() == 0 or piece.data_ptr() == buffer.data_ptr()
            data += piece.numpy().tobytes()
    assert max(asked) == 16 and len(asked) > len(tensors)
    for name, t in tensors.items():
        whole = torch.frombuffer(got[name], dtype=torch.uint8) if got[name] else None
        back = torch.empty(0, dtype=t.dtype) if whole is None else whole.view(t.dtype)
        assert torch.equal(back.reshape(t.shape), t), name

    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with (
        SafetensorsStream(storage, str(path), entry) as stream,
        pytest.raises(CorruptCheckpointError, match=r"p\.safetensors: checksum"),
    ):
        for _ in stream.pieces(16, into):
            pass
