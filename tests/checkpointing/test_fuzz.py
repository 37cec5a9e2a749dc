"""Any bytes in a manifest, a safetensors header, an index or a state file give a result or a
clear checkpoint error, never a crash of another kind."""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError
from accelkit.checkpointing.formats.model_io import read_model_files
from accelkit.checkpointing.formats.safetensors_header import parse_header
from accelkit.checkpointing.formats.state_io import decode_state
from accelkit.checkpointing.storage import get_storage

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=16,
)
_BASE = json.loads(Manifest(iteration=1, step=1, world_size=1, files=[]).to_json())


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(_BASE)), json_values), json_values)
def test_manifest_fields(changes: dict[str, Any], files: Any) -> None:
    data = {**_BASE, **changes}
    if isinstance(files, list):
        data["files"] = files
    try:
        Manifest.from_json(json.dumps(data))
    except ManifestError:
        pass


@FUZZ
@given(st.binary(max_size=200))
def test_manifest_bytes(raw: bytes) -> None:
    try:
        Manifest.from_json(raw)
    except ManifestError:
        pass


_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "I8", "Z"]) | json_values,
        "shape": st.lists(st.integers(-2, 10**12), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-5, 10**13), max_size=3) | json_values,
    }
)


@FUZZ
@given(
    st.dictionaries(st.text(max_size=5), _ENTRY | json_values, max_size=4), st.integers(0, 10**6)
)
def test_safetensors_header(header: dict[str, Any], data_size: int) -> None:
    try:
        raw = json.dumps(header).encode()
        parse_header("x.safetensors", raw, 8 + len(raw) + data_size)
    except CorruptCheckpointError:
        pass


@FUZZ
@given(
    json_values
    | st.fixed_dictionaries(
        {
            "weight_map": st.dictionaries(st.text(max_size=5), json_values, max_size=3),
            "metadata": json_values,
        }
    )
)
def test_index(index: Any) -> None:
    folder = f"memory://accelkit-fuzz/{uuid.uuid4().hex}"
    storage = get_storage(folder)
    storage.write_bytes(f"{folder}/model.safetensors.index.json", json.dumps(index).encode())
    try:
        read_model_files(storage, folder)
    except CorruptCheckpointError:
        pass


_TAGS = ["__tensor__", "__tuple__", "__dict__", "__float__", "__ndarray__", "__npscalar__"]
_TAGS += ["__bytes__", "__dtype__", "__device__", "__size__", "__set__", "__torch__", "x"]
_TAGGED = st.recursive(
    json_values,
    lambda children: (
        st.dictionaries(
            st.sampled_from(_TAGS),
            children,
            max_size=2,
        )
        | st.lists(children, max_size=3)
    ),
    max_leaves=12,
)


@FUZZ
@given(_TAGGED)
def test_state_structure(tree: Any) -> None:
    try:
        decode_state(tree, {}, [], "x.json")
    except CorruptCheckpointError:
        pass
