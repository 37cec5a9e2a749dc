"""Safetensors headers read without loading tensors, and the CLI's table helpers."""

from __future__ import annotations

import json
import struct
import uuid

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.inspect import read_safetensors_header, safetensors_files
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.cli._table import format_age, format_size, render_table


@pytest.fixture
def mem() -> tuple[Storage, str]:
    url = f"memory://accelkit-inspect-tests/{uuid.uuid4().hex[:12]}"
    return get_storage(url), url


def test_header_matches_the_safetensors_library(mem: tuple[Storage, str], tmp_path) -> None:
    storage, root = mem
    tensors = {
        "a.bf16": torch.zeros(3, 5, dtype=torch.bfloat16),
        "b.i64": torch.arange(7),
        "c.bool": torch.ones(2, 2, 2, dtype=torch.bool),
        "d.scalar": torch.tensor(1.5),
        "e.empty": torch.zeros(0, 4),
    }
    data = save(tensors, metadata={"format": "pt"})
    storage.write_bytes(join(root, "m.safetensors"), data)
    header = read_safetensors_header(storage, join(root, "m.safetensors"))
    assert header.metadata == {"format": "pt"}
    assert header.file_size == len(data)
    local = tmp_path / "m.safetensors"
    local.write_bytes(data)
    with safe_open(str(local), framework="pt") as f:
        expected = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    got = {t.name: (t.dtype, list(t.shape)) for t in header.tensors}
    assert got == expected
    sizes = {t.name: t.nbytes for t in header.tensors}
    assert sizes == {k: v.numel() * v.element_size() for k, v in tensors.items()}


def _t(shape: list[int], offsets: list[int], dtype: str | None = "F32") -> dict[str, object]:
    entry: dict[str, object] = {"shape": shape, "data_offsets": offsets}
    if dtype is not None:
        entry["dtype"] = dtype
    return {"t": entry}


def _file(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "shorter than the 8-byte prefix"),
        (struct.pack("<Q", 10**12) + b"{}", "header length prefix"),
        (struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
        (_file([1, 2]), "not a JSON object"),
        (_file(_t([2], [0, 16]), b"\0" * 8), "data_offsets"),
        (_file(_t([3], [0, 8]), b"\0" * 8), "needs 12 bytes"),
        (_file(_t([-1], [0, 0])), "shape"),
        (_file(_t([1], [0, 4], dtype=None), b"\0" * 4), "dtype"),
    ],
)  # fmt: skip
def test_damaged_headers_are_refused(
    mem: tuple[Storage, str], content: bytes, message: str
) -> None:
    storage, root = mem
    url = join(root, "bad.safetensors")
    storage.write_bytes(url, content)
    with pytest.raises(CorruptCheckpointError) as info:
        read_safetensors_header(storage, url)
    assert message in str(info.value) and url in str(info.value)


def test_index_files_must_stay_in_their_folder(mem: tuple[Storage, str]) -> None:
    storage, root = mem
    index = join(root, "model.safetensors.index.json")
    storage.write_bytes(
        index, json.dumps({"weight_map": {"w": "../../secret.safetensors"}}).encode()
    )
    with pytest.raises(CorruptCheckpointError, match=r"\.\."):
        safetensors_files(storage, index)
    storage.write_bytes(index, json.dumps({"weight_map": {"w": "a.safetensors"}}).encode())
    assert safetensors_files(storage, index) == [("a.safetensors", join(root, "a.safetensors"))]


def test_table_helpers() -> None:
    assert [format_size(n) for n in (0, 1023, 1536, 3 * 1024**3, None)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 GiB",
        "-",
    ]
    assert [format_age(s) for s in (-3, 59, 61, 7380, 3 * 86400, None)] == [
        "0s",
        "59s",
        "1m",
        "2h",
        "3d",
        "-",
    ]
    table = render_table(["A", "NUM"], [["x", "1"], ["long", "100"]], right=["NUM"])
    assert table.splitlines() == ["A     NUM", "x       1", "long  100"]
