"""State dicts without pickle: JSON structure + safetensors tensors, exact round trips."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.state_io import (
    decode_state,
    encode_state,
    read_state,
    write_state,
)
from accelkit.checkpointing.objects.rng import capture_rng_state, restore_rng_state
from accelkit.checkpointing.storage import get_storage
from tests.checkpointing.conftest import Root


def _tricky() -> dict[str, Any]:
    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, dtype=torch.bfloat16)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None}],
        "floats": [float("inf"), float("-inf"), 1e-300, 0.1 + 0.2],
        "big_int": 2**80,
        "tuple_keys": {(1, "a"): "x", None: 1, 2.5: "f"},
        "tag_like": {"__tensor__": "not a tag"},
        "np": np.arange(5, dtype=np.uint32),
        "np_scalar": np.float32(1.5),
        "bytes": b"\x00\xff",
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "set": {1, 2, 3},
        "a": shared,
        "b": shared,
        "bool_tensor": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "nested": [[], {}, ()],
    }


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_roundtrip_on_every_storage(root: Root) -> None:
    state = _tricky()
    written = write_state(root.storage, root.url, "optimizer", state)
    assert sorted(written) == ["optimizer.json", "optimizer.safetensors"]
    back = read_state(root.storage, root.url, "optimizer")
    _assert_same(back, state)
    assert back["a"] is back["b"]  # one tensor shared under two keys stays shared
    doc = json.loads(root.storage.read_bytes(f"{root.url}/optimizer.json"))
    assert doc["state"]["floats"][0] == {"__float__": "inf"}


def test_nan_and_plain_structures_without_tensors(tmp_path: Any) -> None:
    storage = get_storage(str(tmp_path))
    state = {"loss": float("nan"), "epoch": 3, "names": ["a", None]}
    written = write_state(storage, str(tmp_path), "custom_checkpoint_0", state)
    assert list(written) == ["custom_checkpoint_0.json"]  # no tensors, no safetensors file
    back = read_state(storage, str(tmp_path), "custom_checkpoint_0")
    assert math.isnan(back["loss"]) and back["epoch"] == 3 and back["names"] == ["a", None]


class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_unknown_objects_fall_back_to_weights_only_torch_load(tmp_path: Any) -> None:
    storage = get_storage(str(tmp_path))
    tree, tensors, extras = encode_state({"c": torch.tensor([1 + 2j])})
    assert tree == {"c": {"__torch__": 0}} and not tensors and len(extras) == 1
    write_state(storage, str(tmp_path), "ok", {"c": torch.tensor([1 + 2j])})
    assert torch.equal(read_state(storage, str(tmp_path), "ok")["c"], torch.tensor([1 + 2j]))
    written = write_state(storage, str(tmp_path), "bad", {"obj": _Opaque()})
    assert "bad.pt" in written
    with pytest.raises(CorruptCheckpointError, match=r"bad\.pt.*weights_only=True"):
        read_state(storage, str(tmp_path), "bad")


class _Boom:
    def __reduce__(self) -> Any:
        return (os.system, ("touch /tmp/accelkit-pwned",))


def test_a_code_running_pickle_is_refused(tmp_path: Any) -> None:
    storage = get_storage(str(tmp_path))
    write_state(storage, str(tmp_path), "evil", {"x": {"__torch__": 0}})
    (tmp_path / "evil.json").write_text(
        json.dumps({"format": "accelkit-state", "version": 1, "state": {"__torch__": 0}})
    )
    (tmp_path / "evil.pt").write_bytes(pickle.dumps([_Boom()], protocol=2))
    with pytest.raises(CorruptCheckpointError, match="weights_only"):
        read_state(storage, str(tmp_path), "evil")
    assert not os.path.exists("/tmp/accelkit-pwned")


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other", "state": 1}', "not an accelkit state file"),
        ('{"format": "accelkit-state", "version": 7, "state": 1}', "upgrade accelkit"),
        ('{"format": "accelkit-state", "version": 1, "state": {"__tensor__": "t9"}}', "t9"),
        ('{"format": "accelkit-state", "version": 1, "state": {"__float__": "big"}}', "__float__"),
    ],
)
def test_malformed_structure_names_the_file(tmp_path: Any, doc: str, match: str) -> None:
    (tmp_path / "scheduler.json").write_text(doc)
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        read_state(get_storage(str(tmp_path)), str(tmp_path), "scheduler")
    assert "scheduler.json" in str(info.value)


def test_decode_rejects_bad_tags() -> None:
    with pytest.raises(CorruptCheckpointError, match="__dict__"):
        decode_state({"__dict__": [[1]]}, {}, [], "x.json")


def test_rng_roundtrip_restores_every_generator(tmp_path: Any) -> None:
    storage = get_storage(str(tmp_path))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    write_state(storage, str(tmp_path), "random_states_0", capture_rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(read_state(storage, str(tmp_path), "random_states_0"))
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])
    with pytest.raises(CorruptCheckpointError, match="generator states"):
        restore_rng_state({"python": 1}, "random_states_0.json")
