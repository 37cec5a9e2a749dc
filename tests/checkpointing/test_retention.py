"""Retention is a pure function: committed checkpoints + policy -> which to delete.

Policies are rules (keep-last, keep-every, keep-best) combined with any-of; one function
(``build_policy``) makes them from ``ProjectConfiguration`` and from ``ckpt prune``'s flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from accelkit.checkpointing import ProjectConfiguration
from accelkit.checkpointing.catalog.retention import (
    AnyOf,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    build_policy,
    select_for_deletion,
)


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
    assert select_for_deletion(_ckpts(5), build_policy()) == []


def test_keep_last_deletes_oldest_in_any_input_order() -> None:
    cks = _ckpts(5)
    doomed = select_for_deletion(list(reversed(cks)), build_policy(keep_last=2))
    assert _names(doomed) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert select_for_deletion(cks[:2], build_policy(keep_last=2)) == []


def test_keep_every_and_keep_last_combine() -> None:
    doomed = select_for_deletion(_ckpts(10), build_policy(keep_last=2, keep_every=4))
    assert _names(doomed) == [f"checkpoint_{i}" for i in (1, 2, 3, 5, 6, 7)]


def test_keep_best_min_and_max() -> None:
    losses = [5.0, 1.0, 3.0, 0.5, 4.0, 2.0]
    cks = _ckpts(6, losses)
    doomed = select_for_deletion(cks, build_policy(keep_last=1, keep_best=2, metric="loss"))
    assert _names(doomed) == ["checkpoint_0", "checkpoint_2", "checkpoint_4"]
    doomed = select_for_deletion(
        cks, build_policy(keep_last=1, keep_best=1, metric="loss", mode="max")
    )
    assert sorted(_names(doomed)) == [f"checkpoint_{i}" for i in (1, 2, 3, 4)]


def test_keep_best_ignores_missing_and_nan_metrics() -> None:
    cks = [
        Ck("checkpoint_0", 0, 0, {"loss": float("nan")}),
        Ck("checkpoint_1", 1, 1, {}),
        Ck("checkpoint_2", 2, 2, {"loss": 9.0}),
        Ck("checkpoint_3", 3, 3, {"acc": 1.0}),
    ]
    doomed = select_for_deletion(cks, build_policy(keep_best=1, metric="loss"))
    assert _names(doomed) == ["checkpoint_0", "checkpoint_1", "checkpoint_3"]


def test_checkpoints_without_iteration_count_as_oldest() -> None:
    cks = [Ck("final", None, 100.0), *_ckpts(2)]
    assert _names(select_for_deletion(cks, build_policy(keep_last=2))) == ["final"]


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
        build_policy(**kwargs)  # type: ignore[arg-type]


def test_project_configuration_validates_retention_early() -> None:
    with pytest.raises(ValueError, match="total_limit must be >= 1"):
        ProjectConfiguration(total_limit=0)
    policy = ProjectConfiguration(total_limit=3, keep_every=5).retention_policy()
    assert policy == AnyOf((KeepLast(3), KeepEvery(5)))
    with pytest.raises(ValueError, match=r"ProjectConfiguration: keep_best needs.*best_metric"):
        ProjectConfiguration(keep_best=2)
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max'"):
        ProjectConfiguration(keep_best=1, best_metric="loss", best_mode="low")


def test_build_policy_makes_single_rules_unions_or_keep_all() -> None:
    assert build_policy() == KeepAll() and build_policy().is_unlimited
    assert build_policy(keep_last=2) == KeepLast(2)
    both = build_policy(keep_last=1, keep_best=2, metric="loss", mode="max")
    assert both == AnyOf((KeepLast(1), KeepBest(2, "loss", "max")))
    assert both.rules == (KeepLast(1), KeepBest(2, "loss", "max"))
    # Errors name the setting as the caller knows it.
    with pytest.raises(ValueError, match="--keep must be >= 1"):
        build_policy(keep_last=0, names={"keep_last": "--keep"})


def test_rules_compose_by_hand() -> None:
    """AnyOf nests; a checkpoint is kept if any rule keeps it."""
    cks = _ckpts(12, [float(12 - i) if i != 2 else 0.1 for i in range(12)])
    policy = AnyOf((KeepLast(1), AnyOf((KeepEvery(5), KeepBest(1, "loss")))))
    kept = sorted(set(_names(cks)) - set(_names(select_for_deletion(cks, policy))))
    assert kept == [
        "checkpoint_0",
        "checkpoint_10",
        "checkpoint_11",
        "checkpoint_2",
        "checkpoint_5",
    ]
    assert policy.rules == (KeepLast(1), KeepEvery(5), KeepBest(1, "loss"))
    assert select_for_deletion(cks, AnyOf((KeepLast(1), KeepAll()))) == []
    with pytest.raises(ValueError, match="AnyOf takes one or more"):
        AnyOf(())
    with pytest.raises(ValueError, match="KeepLast count must be >= 1"):
        KeepLast(0)
