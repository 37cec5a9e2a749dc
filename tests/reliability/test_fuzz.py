"""Fuzz the parsers of untrusted checkpoint metadata with hypothesis.

Manifests (``Manifest.from_json``), safetensors headers (the loader's ``read_safetensors`` and
the CLI's ``read_safetensors_header``), model indexes (``load_checkpoint_in_model`` on an
index) and DCP's pickled ``.metadata`` (``read_sharded_metadata``: arbitrary bytes and real
metadata with bytes flipped, cut, deleted and opcodes spliced in) get arbitrary bytes and
arbitrary input shaped like the real thing: each input gives a result or the package's own
error (``ManifestError`` / ``CorruptCheckpointError``), never any other exception. Files live
on fsspec ``memory://`` (fast, no disk), except for the local memory-mapped safetensors path.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import tempfile
import uuid
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from accelkit.checkpointing.catalog.inspect import read_safetensors_header
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError
from accelkit.checkpointing.formats.model_io import load_checkpoint_in_model
from accelkit.checkpointing.formats.safetensors_io import read_safetensors
from accelkit.checkpointing.storage import get_storage
from tests.reliability.conftest import FULL

EXAMPLES = 1500 if FULL else 150
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not FULL,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_names = st.one_of(
    st.sampled_from(["model.safetensors", "../x", "/etc/passwd", "a/../../b", "a\\b", "", "."]),
    st.text(max_size=12),
    _json,
)

_VALID = json.loads(
    Manifest(
        iteration=3,
        step=7,
        world_size=1,
        files=[],
        created=1.7e9,
        accelkit_version="0.1.0",
        torch_version="2.5",
    ).to_json()
)
_VALID["files"] = [
    {"path": "model.safetensors", "size": 10, "checksum": "xxh3_128:" + "0" * 32},
]


@st.composite
def _manifests(draw: st.DrawFn) -> Any:
    data = json.loads(json.dumps(_VALID))
    for key in draw(st.lists(st.sampled_from(sorted(data)), max_size=4, unique=True)):
        if draw(st.booleans()):
            del data[key]
        else:
            data[key] = draw(_json)
    if "files" in data and isinstance(data["files"], list) and draw(st.booleans()):
        entry = {
            "path": draw(_names),
            "size": draw(st.one_of(st.integers(min_value=-5, max_value=2**65), _json)),
            "checksum": draw(
                st.one_of(st.sampled_from(["xxh3_128:" + "0" * 32, "sha256:zz", "md5:1"]), _json)
            ),
        }
        data["files"].append(entry)
    return data


def _parse_manifest(raw: bytes | str) -> None:
    try:
        Manifest.from_json(raw, source="fuzz/accelkit.json")
    except ManifestError as exc:
        assert "fuzz/accelkit.json" in str(exc)


@FUZZ
@given(st.one_of(st.binary(max_size=200), _manifests().map(json.dumps)))
def test_manifest_parsing_never_crashes(raw: bytes | str) -> None:
    _parse_manifest(raw)


_DEEP = ("[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000)


def test_deeply_nested_json_is_refused_cleanly() -> None:
    """JSON nested 100,000 deep overflows Python's recursive decoder (RecursionError)."""
    for raw in (*_DEEP, "1e999999"):
        _parse_manifest(raw)
    for raw in _DEEP:
        blob = raw.encode()
        url = f"memory://fuzz/{uuid.uuid4().hex}.safetensors"
        storage = get_storage(url)
        storage.write_bytes(url, struct.pack("<Q", len(blob)) + blob)
        for read in (read_safetensors_header, read_safetensors):
            try:
                read(storage, url)
            except CorruptCheckpointError as exc:
                assert url in str(exc)
        index = f"memory://fuzz-index/{uuid.uuid4().hex}/model.safetensors.index.json"
        storage.write_bytes(index, blob)
        try:
            load_checkpoint_in_model(nn.Linear(2, 2), index)
        except CorruptCheckpointError as exc:
            assert "model.safetensors.index.json" in str(exc)


_DTYPES = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", "C64"])
_INTS = st.one_of(st.integers(min_value=0, max_value=64), st.integers(-(2**65), 2**65))


@st.composite
def _safetensors_files(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64))
    header: dict[str, Any] = {}
    for name in draw(st.lists(st.text(max_size=6), max_size=4, unique=True)):
        entry = {
            "dtype": draw(_DTYPES),
            "shape": draw(st.lists(_INTS, max_size=3)),
            "data_offsets": draw(st.lists(_INTS, min_size=2, max_size=2)),
        }
        if draw(st.integers(0, 5)) == 0:
            entry = draw(_json)
        header[name] = entry
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(_json, st.just({"format": "pt"})))
    raw = json.dumps(header).encode()
    length = len(raw)
    if draw(st.integers(0, 5)) == 0:
        length = draw(st.integers(0, 2**64 - 1))
    data = draw(st.binary(max_size=96))
    return struct.pack("<Q", length) + raw + data


@FUZZ
@given(_safetensors_files())
def test_safetensors_header_parsing_never_crashes(blob: bytes) -> None:
    url = f"memory://fuzz/{uuid.uuid4().hex}.safetensors"
    storage = get_storage(url)
    storage.write_bytes(url, blob)
    try:
        try:
            read_safetensors_header(storage, url)
        except CorruptCheckpointError as exc:
            assert url in str(exc)
        try:
            tensors, _ = read_safetensors(storage, url)
        except CorruptCheckpointError as exc:
            assert url in str(exc)
        else:
            assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    finally:
        storage.remove(url)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=100),
        st.builds(
            lambda wm, meta: json.dumps({"metadata": meta, "weight_map": wm}),
            st.one_of(st.dictionaries(st.text(max_size=6), _names, max_size=3), _json),
            _json,
        ),
    )
)
def test_index_parsing_never_crashes(raw: bytes | str) -> None:
    folder = f"memory://fuzz-index/{uuid.uuid4().hex}"
    storage = get_storage(folder)
    index = f"{folder}/model.safetensors.index.json"
    storage.write_bytes(index, raw.encode() if isinstance(raw, str) else raw)
    try:
        load_checkpoint_in_model(nn.Linear(2, 2), index)
    except CheckpointError as exc:  # corrupt, or keys that do not fit the model
        assert "model.safetensors.index.json" in str(exc)
    finally:
        storage.rmtree(folder)


# ------------------------------------------------------------------ issue 15: more parsers


@st.composite
def _empty_tensor_files(draw: st.DrawFn) -> bytes:
    """Headers whose tensors hold no bytes but claim dimensions no tensor can have."""
    header: dict[str, Any] = {}
    for name in draw(
        st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3, unique=True)
    ):
        dims = draw(st.lists(st.integers(0, 2**70), min_size=1, max_size=4))
        if 0 not in dims and draw(st.booleans()):
            dims.insert(draw(st.integers(0, len(dims))), 0)
        at = draw(st.integers(0, 16))
        header[name] = {"dtype": draw(_DTYPES), "shape": dims, "data_offsets": [at, at]}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * 16


_LOCAL_DIR = tempfile.mkdtemp(prefix="accelkit-fuzz-")
atexit.register(shutil.rmtree, _LOCAL_DIR, True)


@FUZZ
@given(st.one_of(_empty_tensor_files(), _safetensors_files()))
def test_safetensors_readers_never_crash_on_local_files(blob: bytes) -> None:
    """The local (memory-mapped, ``zero_copy``) path that ``load_state`` uses, and the CLI's
    header reader, on the same hostile files: ``CorruptCheckpointError`` or a result."""
    path = os.path.join(_LOCAL_DIR, f"{uuid.uuid4().hex}.safetensors")
    storage = get_storage(path)
    with open(path, "wb") as f:
        f.write(blob)
    try:
        for zero_copy in (True, False):
            try:
                read_safetensors(storage, path, zero_copy=zero_copy)
            except CorruptCheckpointError as exc:
                assert path in str(exc)
        try:
            read_safetensors_header(storage, path)
        except CorruptCheckpointError as exc:
            assert path in str(exc)
    finally:
        os.remove(path)


_VALID_METADATA: list[bytes] = []


def _valid_metadata() -> bytes:
    """A real DCP ``.metadata`` (written once, by DCP, in this process, on ``memory://``)."""
    if not _VALID_METADATA:
        import warnings

        from accelkit.checkpointing.sharded import write_sharded

        url = f"memory://fuzz-dcp/{uuid.uuid4().hex}"
        state = {"model": {"w": torch.ones(3, 2), "b": torch.zeros(2)}, "optimizer": {"lr": 0.1}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            write_sharded(get_storage(url), url, state)
        _VALID_METADATA.append(get_storage(url).read_bytes(f"{url}/sharded/.metadata"))
    return _VALID_METADATA[0]


# Opcode fragments to splice into valid metadata: structure, memo, counted and extension
# opcodes, and calls of allowed names with wrong arguments. No name outside the allow-list that
# could change this process (test_hostile_dcp.py covers those one by one).
_FRAGMENTS = [
    b"(",
    b")",
    b"t",
    b"\x85",
    b"\x86",
    b"\x87",
    b"R",
    b"b",
    b"o",
    b"s",
    b"u",
    b"e",
    b"a",
    b"0",
    b"1",
    b"2",
    b"N",
    b"}",
    b"]",
    b"\x88",
    b"\x89",
    b"\x94",
    b"\x95" + struct.pack("<Q", 2**40),
    b"h\x00",
    b"h\xff",
    b"j" + struct.pack("<I", 2**31),
    b"\x82\x01",
    b"\x83\xff\xff",
    b"\x84" + struct.pack("<i", -1),
    b"\x8e" + struct.pack("<Q", 2**40),
    b"\x8d" + struct.pack("<Q", 2**62),
    b"\x96" + struct.pack("<Q", 2**33),
    b"\x97",
    b"\x98",
    b"K\x05",
    b"J\xff\xff\xff\xff",
    b"\x8a\x09" + b"\xff" * 9,
    b"G" + struct.pack(">d", float("nan")),
    b"\x8c\x05torch\x8c\x04Size\x93",
    b"\x8c\x13torch.serialization\x8c\x0b_get_layout\x93",
    b"\x8c%torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93",
    b"\x8c\x07pathlib\x8c\tPosixPath\x93",
    b"\x8c\x05torch\x8c\x07float32\x93",
    b"\x8c\x0bcollections\x8c\x0bOrderedDict\x93",
]


@st.composite
def _mutated_metadata(draw: st.DrawFn) -> bytes:
    data = bytearray(_valid_metadata())
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "splice", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "splice":
            data[at:at] = draw(st.sampled_from(_FRAGMENTS))
        else:
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


@FUZZ
@given(st.one_of(st.binary(max_size=200), _mutated_metadata()))
def test_dcp_metadata_reader_never_crashes(raw: bytes) -> None:
    """``read_sharded_metadata`` on arbitrary bytes and on mutated real metadata: a DCP
    ``Metadata`` or a ``CorruptCheckpointError`` naming the file, never another exception."""
    from accelkit.checkpointing.sharded import read_sharded_metadata

    folder = f"memory://fuzz-dcp/{uuid.uuid4().hex}/sharded"
    storage = get_storage(folder)
    storage.write_bytes(f"{folder}/.metadata", raw)
    try:
        read_sharded_metadata(storage, folder)
    except CorruptCheckpointError as exc:
        assert ".metadata" in str(exc)
    finally:
        storage.rmtree(folder)
