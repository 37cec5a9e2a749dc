"""Fuzz the parsers of untrusted checkpoint metadata with hypothesis.

Manifests (``Manifest.from_json``), safetensors headers (the loader's ``read_safetensors`` and
the CLI's ``read_safetensors_header``) and model indexes (``load_checkpoint_in_model`` on an
index) get arbitrary bytes and arbitrary JSON shaped like the real thing: each input gives a
result or the package's own error (``ManifestError`` / ``CorruptCheckpointError``), never any
other exception. Files live on fsspec ``memory://`` (fast, no disk).
"""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.inspect import read_safetensors_header
from accelkit.checkpointing.manifest import Manifest, ManifestError
from accelkit.checkpointing.model_io import load_checkpoint_in_model
from accelkit.checkpointing.safetensors_io import read_safetensors
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
