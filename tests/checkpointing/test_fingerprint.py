"""The resume fingerprint's record: digests, the random streams, the check of a record read
from a checkpoint, and the differences between two records."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.objects.fingerprint import (
    DIGEST_PREFIX,
    Difference,
    check_fingerprint,
    differences,
    digest,
    rng_components,
)


def test_digest_is_stable_and_tells_values_apart() -> None:
    batches = [[3, 1, 2], [0, 5, 4]]
    assert digest(batches) == digest([[3, 1, 2], [0, 5, 4]])
    assert digest(batches).startswith(DIGEST_PREFIX) and len(digest(batches)) == 23
    assert digest(batches) != digest([[3, 1, 2], [0, 4, 5]])
    assert digest([[1, 2], [3]]) != digest([[1], [2, 3]])  # batch boundaries count
    t = torch.arange(4, dtype=torch.uint8)
    assert digest(t) == digest(t.clone()) != digest(t.to(torch.int64))
    assert digest({"b": 1, "a": 2}) == digest({"a": 2, "b": 1})
    assert digest(np.arange(3)) != digest(np.arange(3) + 1)


def test_rng_components_follow_each_stream() -> None:
    before = rng_components()
    assert set(before) >= {"RNG stream python", "RNG stream numpy", "RNG stream torch"}
    assert rng_components() == before  # computing them draws nothing
    torch.rand(1)
    after = rng_components()
    assert [k for k in before if before[k] != after[k]] == ["RNG stream torch"]
    random.random()
    np.random.rand()
    changed = rng_components()
    assert changed["RNG stream python"] != after["RNG stream python"]
    assert changed["RNG stream numpy"] != after["RNG stream numpy"]


@pytest.mark.parametrize(
    "value",
    [[], {"world size": 2}, {"a": "x" * 5000}, "world size", {"a": None}],
)
def test_a_record_that_is_not_one_is_refused(value: Any) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/resume_fingerprint_0.json: expected"):
        check_fingerprint(value, "ckpt/resume_fingerprint_0.json")


def test_differences_name_each_component_once() -> None:
    saved = {"world size": "2", "dataloader 0 batch size": "8", "RNG stream torch": digest(1)}
    now = {"world size": "2", "dataloader 0 batch size": "4", "RNG stream torch": digest(2)}
    now["RNG stream cuda"] = digest(3)
    found = differences(saved, now)
    assert [d.describe() for d in found] == [
        "dataloader 0 batch size 8 -> 4",
        "RNG stream torch differs",
        "RNG stream cuda is new (the saved run had none)",
    ]
    assert differences(saved, dict(saved)) == []
    assert Difference("x", "1", None).describe() == "x is missing (the saved run had one)"
