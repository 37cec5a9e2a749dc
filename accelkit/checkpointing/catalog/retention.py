"""Retention: which committed checkpoints to delete. Pure: no I/O, no clock.

A policy is a rule, or rules combined:

- :class:`KeepLast` -- the newest N (``ProjectConfiguration.total_limit``, ``ckpt prune --keep``);
- :class:`KeepEvery` -- every checkpoint whose iteration is a multiple of N;
- :class:`KeepBest` -- the best K by a metric given at save time (``"min"``: lower is better);
- :class:`AnyOf` -- a checkpoint is kept if any of its policies keeps it (a union);
- :class:`KeepAll` -- no rule: nothing is ever deleted.

:func:`build_policy` makes the policy that training's ``ProjectConfiguration`` and
``accelkit ckpt prune``'s flags describe (one function for both, so they cannot disagree), and
:func:`select_for_deletion` applies one. :func:`plan_retention` applies one so that no project
is ever left without a checkpoint that verifies: it asks a caller-given check about the
checkpoints it would keep, never counts a damaged one (kept, reported), and never deletes the
newest intact one (both training and ``ckpt prune`` delete through it; the check is theirs,
so this module stays free of I/O). Its inputs are any objects with ``name``,
``iteration`` (int or ``None``), ``created`` (float) and ``metrics`` (mapping) -- e.g.
:class:`~accelkit.checkpointing.catalog.listing.CheckpointInfo` -- and must be *committed*
checkpoints only: the caller never passes incomplete folders or stray ones such as
``checkpoints/best``.

Public API: :class:`RetentionPolicy` (the base), :class:`KeepAll`, :class:`KeepLast`,
:class:`KeepEvery`, :class:`KeepBest`, :class:`AnyOf`, :func:`build_policy`,
:func:`select_for_deletion`, :func:`plan_retention`, :class:`RetentionPlan`,
:class:`RetentionCandidate`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from typing_extensions import override

__all__ = [
    "AnyOf",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "RetentionCandidate",
    "RetentionPlan",
    "RetentionPolicy",
    "build_policy",
    "plan_retention",
    "select_for_deletion",
]


class RetentionCandidate(Protocol):
    """What retention needs to know about a committed checkpoint."""

    @property
    def name(self) -> str: ...

    @property
    def iteration(self) -> int | None: ...

    @property
    def created(self) -> float: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...


C = TypeVar("C", bound=RetentionCandidate)


def _check_count(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}.")
    if value < 1:
        raise ValueError(
            f"{name} must be >= 1 or None, got {value}. Use None to disable this rule."
        )


class RetentionPolicy(abc.ABC):
    """Which of a list of committed checkpoints to keep."""

    @abc.abstractmethod
    def kept(self, ordered: Sequence[RetentionCandidate]) -> set[int]:
        """The indexes of the checkpoints kept, ``ordered`` oldest first."""

    @property
    def is_unlimited(self) -> bool:
        """True when the policy keeps everything (no rule): nothing is ever deleted."""
        return False

    @property
    def rules(self) -> tuple[RetentionPolicy, ...]:
        """The single rules this policy combines (itself for a single rule)."""
        return (self,)


@dataclass(frozen=True)
class KeepAll(RetentionPolicy):
    """No rule: keep every checkpoint."""

    @override
    def kept(self, ordered: Sequence[RetentionCandidate]) -> set[int]:
        return set(range(len(ordered)))

    @property
    @override
    def is_unlimited(self) -> bool:
        return True

    @property
    @override
    def rules(self) -> tuple[RetentionPolicy, ...]:
        return ()


@dataclass(frozen=True)
class KeepLast(RetentionPolicy):
    """Keep the newest ``count``."""

    count: int

    def __post_init__(self) -> None:
        _check_count(self.count, "KeepLast count")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate]) -> set[int]:
        return set(range(max(0, len(ordered) - self.count), len(ordered)))


@dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose iteration is a multiple of ``every``."""

    every: int

    def __post_init__(self) -> None:
        _check_count(self.every, "KeepEvery every")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate]) -> set[int]:
        return {
            i
            for i, c in enumerate(ordered)
            if c.iteration is not None and c.iteration % self.every == 0
        }


@dataclass(frozen=True)
class KeepBest(RetentionPolicy):
    """Keep the best ``count`` by ``metric`` (``mode="min"``: lower is better, e.g. a loss).

    Checkpoints lacking the metric, or whose value is NaN, are never among the best (another
    rule may keep them); of equal values the newer wins.
    """

    count: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _check_count(self.count, "KeepBest count")
        if not self.metric:
            raise ValueError("KeepBest needs a metric name, got an empty one.")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}.")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate]) -> set[int]:
        scored = []
        for i, c in enumerate(ordered):
            value = c.metrics.get(self.metric)
            if value is None or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            scored.append((value if self.mode == "min" else -value, -i, i))
        scored.sort()
        return {i for _, _, i in scored[: self.count]}


@dataclass(frozen=True)
class AnyOf(RetentionPolicy):
    """Keep a checkpoint if any of ``policies`` keeps it."""

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if not isinstance(p, RetentionPolicy)]
        if bad or not self.policies:
            raise ValueError(
                f"AnyOf takes one or more RetentionPolicy objects, got {self.policies!r}."
            )

    @override
    def kept(self, ordered: Sequence[RetentionCandidate]) -> set[int]:
        keep: set[int] = set()
        for policy in self.policies:
            keep |= policy.kept(ordered)
        return keep

    @property
    @override
    def is_unlimited(self) -> bool:
        return any(p.is_unlimited for p in self.policies)

    @property
    @override
    def rules(self) -> tuple[RetentionPolicy, ...]:
        return tuple(rule for p in self.policies for rule in p.rules)


_FIELDS = ("keep_last", "keep_every", "keep_best", "metric", "mode")


def build_policy(
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    names: Mapping[str, str] | None = None,
) -> RetentionPolicy:
    """The policy of these settings: the union of the rules set, :class:`KeepAll` if none.

    Args:
        keep_last: keep the newest N.
        keep_every: also keep every checkpoint whose iteration is a multiple of N.
        keep_best: also keep the best K by ``metric``.
        metric: the metric name for ``keep_best`` (given at save time).
        mode: ``"min"`` (lower is better) or ``"max"``.
        names: what the caller calls each setting, for error messages (e.g.
            ``{"keep_last": "total_limit"}`` or ``{"keep_last": "--keep"}``).

    Raises:
        ValueError: naming the bad setting: a count < 1 or not an int, ``keep_best`` without
            ``metric``, a bad ``mode``.

    Example:
        >>> build_policy(keep_last=2, keep_every=10)
        AnyOf(policies=(KeepLast(count=2), KeepEvery(every=10)))
    """
    name = {f: f for f in _FIELDS} | dict(names or {})
    for field_name, value in (
        ("keep_last", keep_last),
        ("keep_every", keep_every),
        ("keep_best", keep_best),
    ):
        if value is not None:
            _check_count(value, name[field_name])
    if keep_best is not None and not metric:
        raise ValueError(
            f"{name['keep_best']} needs a metric name: set {name['metric']} to '<name>' and give "
            "that metric at save time (save_state(..., metrics={'<name>': value}))."
        )
    if mode not in ("min", "max"):
        raise ValueError(f"{name['mode']} must be 'min' or 'max', got {mode!r}.")
    rules: list[RetentionPolicy] = []
    if keep_last is not None:
        rules.append(KeepLast(keep_last))
    if keep_every is not None:
        rules.append(KeepEvery(keep_every))
    if keep_best is not None and metric:
        rules.append(KeepBest(keep_best, metric, mode))
    if not rules:
        return KeepAll()
    return rules[0] if len(rules) == 1 else AnyOf(tuple(rules))


def _order_key(candidate: RetentionCandidate) -> tuple[int, float, str]:
    iteration = candidate.iteration
    return (-1 if iteration is None else iteration, candidate.created, candidate.name)


def select_for_deletion(checkpoints: Sequence[C], policy: RetentionPolicy) -> list[C]:
    """Return the checkpoints ``policy`` does not keep, oldest first.

    Age is the iteration, then the creation time (checkpoints without an iteration count as
    oldest).

    Example:
        >>> select_for_deletion(ckpts, AnyOf((KeepLast(2), KeepEvery(10))))
    """
    if policy.is_unlimited:
        return []
    ordered = sorted(checkpoints, key=_order_key)
    keep = policy.kept(ordered)
    return [c for i, c in enumerate(ordered) if i not in keep]


@dataclass(frozen=True)
class RetentionPlan(Generic[C]):
    """What :func:`plan_retention` decided.

    Attributes:
        delete: the checkpoints to delete, oldest first (each one the policy does not keep).
        damaged: ``(checkpoint, why)`` for each one the check found damaged, oldest first:
            kept, never counted toward the policy (so an intact older one is kept in its
            place), never deleted.
        protected: the newest checkpoint that passed the check, when the policy alone would
            have deleted it (e.g. ``KeepEvery`` or ``KeepBest`` without ``KeepLast``); kept.
        intact: the newest checkpoint that passed the check, or ``None`` if none did (then no
            checkpoint is deleted at all).
    """

    delete: list[C] = field(default_factory=list)
    damaged: list[tuple[C, str]] = field(default_factory=list)
    protected: C | None = None
    intact: C | None = None


def plan_retention(
    checkpoints: Sequence[C], policy: RetentionPolicy, damage: Callable[[C], str | None]
) -> RetentionPlan[C]:
    """Apply ``policy`` so that the project keeps a checkpoint that verifies.

    ``damage(checkpoint)`` says why a checkpoint cannot be trusted (``None``: intact). It is
    asked only about the checkpoints the plan keeps, newest first, each at most once: a
    damaged one leaves the candidates and the policy is applied again to the others, so it
    never counts toward ``KeepLast`` (the next older intact one is kept instead) and is never
    deleted. Then the newest checkpoint that passes is kept whatever the policy says. What is
    deleted was never asked about (it may be damaged; deleting it loses nothing).

    Args:
        checkpoints: committed checkpoints (see :func:`select_for_deletion`).
        policy: what to keep.
        damage: the check: ``accelkit ckpt prune`` compares checksums; training retention
            trusts the checkpoint it just wrote and the sizes the listing checked (see
            :func:`~accelkit.checkpointing.commit.deletion.apply_retention`).

    Returns:
        The plan; nothing is deleted when ``policy`` keeps everything.

    Example:
        >>> plan = plan_retention(ckpts, KeepLast(1), lambda c: None if c.ok else "bad")
    """
    ordered = sorted(checkpoints, key=_order_key)
    if policy.is_unlimited:
        return RetentionPlan()
    why: dict[int, str | None] = {}  # index in ordered -> the check's answer

    def check(i: int) -> bool:
        if i not in why:
            why[i] = damage(ordered[i])
        return why[i] is None

    while True:
        candidates = [i for i in range(len(ordered)) if why.get(i) is None]
        kept = {candidates[k] for k in policy.kept([ordered[i] for i in candidates])}
        unchecked = sorted((i for i in kept if i not in why), reverse=True)
        if not unchecked:
            break
        for i in unchecked:
            check(i)  # a damaged one leaves the candidates: apply the policy again
    doomed = [i for i in candidates if i not in kept]
    protected = intact = None
    for i in reversed(candidates):
        if check(i):  # the newest that passes, asked only if the policy would delete it
            intact = i
            if i in doomed:
                doomed.remove(i)
                protected = i
            break
    failed = _failed(why)
    return RetentionPlan(
        delete=[ordered[i] for i in doomed if i not in failed],
        damaged=[(ordered[i], str(why[i])) for i in sorted(failed)],
        protected=None if protected is None else ordered[protected],
        intact=None if intact is None else ordered[intact],
    )


def _failed(answers: Mapping[int, str | None]) -> set[int]:
    return {i for i, reason in answers.items() if reason is not None}
