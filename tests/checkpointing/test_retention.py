"""Retention is a pure function: committed checkpoints + policy -> which to delete."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from accelkit.checkpointing import ProjectConfiguration
from accelkit.checkpointing.retention import RetentionPolicy, select_for_deletion


@dataclass(frozen=True)
class Ck:
    name: str
    iteration: int | None
    created: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def _ckpts(n: int, losses: list[float] | None = None) -> list[Ck]:
    return [
        Ck(f"checkpoint_{i}", i, float(i), {"loss": losses[i]} if losses else {}) for i in range(n)
    ]


def _names(cks: list[Ck]) -> list[str]:
    return [c.name for c in cks]


def test_no_rule_keeps_everything() -> None:
    assert select_for_deletion(_ckpts(5), RetentionPolicy()) == []


def test_keep_last_deletes_oldest_in_any_input_order() -> None:
    cks = _ckpts(5)
    doomed = select_for_deletion(list(reversed(cks)), RetentionPolicy(keep_last=2))
    assert _names(doomed) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert select_for_deletion(cks[:2], RetentionPolicy(keep_last=2)) == []


def test_keep_every_and_keep_last_combine() -> None:
    doomed = select_for_deletion(_ckpts(10), RetentionPolicy(keep_last=2, keep_every=4))
    assert _names(doomed) == [f"checkpoint_{i}" for i in (1, 2, 3, 5, 6, 7)]


def test_keep_best_min_and_max() -> None:
    losses = [5.0, 1.0, 3.0, 0.5, 4.0, 2.0]
    cks = _ckpts(6, losses)
    doomed = select_for_deletion(cks, RetentionPolicy(keep_last=1, keep_best=2, metric="loss"))
    assert _names(doomed) == ["checkpoint_0", "checkpoint_2", "checkpoint_4"]
    doomed = select_for_deletion(
        cks, RetentionPolicy(keep_last=1, keep_best=1, metric="loss", mode="max")
    )
    assert sorted(_names(doomed)) == [f"checkpoint_{i}" for i in (1, 2, 3, 4)]


def test_keep_best_ignores_missing_and_nan_metrics() -> None:
    cks = [
        Ck("checkpoint_0", 0, 0, {"loss": float("nan")}),
        Ck("checkpoint_1", 1, 1, {}),
        Ck("checkpoint_2", 2, 2, {"loss": 9.0}),
        Ck("checkpoint_3", 3, 3, {"acc": 1.0}),
    ]
    doomed = select_for_deletion(cks, RetentionPolicy(keep_best=1, metric="loss"))
    assert _names(doomed) == ["checkpoint_0", "checkpoint_1", "checkpoint_3"]


def test_checkpoints_without_iteration_count_as_oldest() -> None:
    cks = [Ck("final", None, 100.0), *_ckpts(2)]
    assert _names(select_for_deletion(cks, RetentionPolicy(keep_last=2))) == ["final"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_last": 0}, "keep_last must be >= 1"),
        ({"keep_every": -1}, "keep_every"),
        ({"keep_best": 2}, "metric"),
        ({"keep_best": 1, "metric": "x", "mode": "best"}, "'min' or 'max'"),
        ({"keep_last": True}, "int"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


def test_project_configuration_validates_retention_early() -> None:
    with pytest.raises(ValueError, match="total_limit must be >= 1"):
        ProjectConfiguration(total_limit=0)
    policy = ProjectConfiguration(total_limit=3, keep_every=5).retention_policy()
    assert (policy.keep_last, policy.keep_every) == (3, 5)
