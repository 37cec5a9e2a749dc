"""Retention: which committed checkpoints to delete. Pure: no I/O, no clock.

A policy is a rule, or rules combined:

- :class:`KeepLast` -- the newest N (``ProjectConfiguration.total_limit``, ``ckpt prune --keep``);
- :class:`KeepEvery` -- every checkpoint whose iteration is a multiple of N;
- :class:`KeepBest` -- the best K by a metric given at save time (``"min"``: lower is better);
- :class:`KeepEverySeconds` -- one checkpoint (the first committed) in every T-second window
  of the clock (``keep_every_seconds``, ``ckpt prune --keep-one-every``);
- :class:`KeepRecent` -- every checkpoint committed in the last T seconds
  (``keep_recent_seconds``, ``ckpt prune --keep-recent``);
- :class:`AnyOf` -- a checkpoint is kept if any of its policies keeps it (a union);
- :class:`KeepAll` -- no rule: nothing is ever deleted;
- :class:`MaxTotalBytes` -- a byte budget on top of a policy (``max_total_bytes``, ``ckpt prune
  --max-bytes``): not a rule that keeps, a cap that removes the oldest removable checkpoints,
  even ones the rules keep, until the checkpoints folder fits.

:func:`build_policy` makes the policy that training's ``ProjectConfiguration`` and
``accelkit ckpt prune``'s flags describe (one function for both, so they cannot disagree), and
:func:`select_for_deletion` applies one. :func:`plan_retention` applies one so that no project
is ever left without a checkpoint that verifies: it asks a caller-given check about the
checkpoints it would keep, never counts a damaged one (kept, reported), and never deletes the
newest intact one (both training and ``ckpt prune`` plan through it; the check is theirs,
and so is the clock, ``now``: this module stays free of I/O). Its inputs are every folder the
listing found, with ``name``, ``iteration`` (int or ``None``), ``created`` (the commit time,
UNIX seconds), ``metrics`` (mapping), ``state``, ``is_automatic`` and ``size_bytes`` -- e.g.
:class:`~accelkit.checkpointing.catalog.listing.CheckpointInfo`. Only committed
``checkpoint_<n>`` ones are counted by the rules and ever deleted by them; the others
(foreign folders, Hugging Face accelerate's, corrupt ones, those named by the script) count
toward a byte budget and are never deleted; incomplete ones are deleted only when the caller
asks (``ckpt prune``) and only when older than the newest committed checkpoint.
:func:`select_for_deletion` takes committed checkpoints only (the remote tier's queue).

Public API: :class:`RetentionPolicy` (the base), :class:`KeepAll`, :class:`KeepLast`,
:class:`KeepEvery`, :class:`KeepBest`, :class:`KeepEverySeconds`, :class:`KeepRecent`,
:class:`AnyOf`, :class:`MaxTotalBytes`, :func:`build_policy`, :func:`select_for_deletion`,
:func:`plan_retention`, :class:`RetentionPlan`, :class:`RetentionCandidate`,
:class:`ListedCheckpoint`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from typing_extensions import override

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = [
    "AnyOf",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepLast",
    "KeepRecent",
    "ListedCheckpoint",
    "MaxTotalBytes",
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


class ListedCheckpoint(RetentionCandidate, Protocol):
    """A folder as the listing found it: what :func:`plan_retention` needs."""

    @property
    def state(self) -> str: ...

    @property
    def is_automatic(self) -> bool: ...

    @property
    def size_bytes(self) -> int: ...


# The states of catalog.listing that the plan acts on (kept here as text so that this module
# imports nothing of storage).
_COMMITTED = "committed"
_INCOMPLETE = "incomplete"

C = TypeVar("C", bound=RetentionCandidate)
L = TypeVar("L", bound=ListedCheckpoint)


def _check_seconds(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"{name} must be a number of seconds > 0 or None, got {short(value)}; e.g. "
            f"{name}=3600 (an hour)."
        )
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(
            f"{name} must be a finite number of seconds > 0, got {value}. Use None to disable "
            "this rule."
        )


def _check_bytes(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{name} must be an int number of bytes >= 1 or None, got {short(value)}; e.g. "
            f"{name}=50 * 2**30 for 50 GiB. Use None for no budget."
        )


def _check_count(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int >= 1 or None, got {value!r}.")
    if value < 1:
        raise ConfigurationError(
            f"{name} must be >= 1 or None, got {value}. Use None to disable this rule."
        )


class RetentionPolicy(abc.ABC):
    """Which of a list of committed checkpoints to keep."""

    @abc.abstractmethod
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        """The indexes of the checkpoints kept, ``ordered`` oldest first; ``now`` (UNIX
        seconds) is the clock of the rules that need one (:class:`KeepRecent`)."""

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
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
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
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        return set(range(max(0, len(ordered) - self.count), len(ordered)))


@dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose iteration is a multiple of ``every``."""

    every: int

    def __post_init__(self) -> None:
        _check_count(self.every, "KeepEvery every")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
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
            raise ConfigurationError("KeepBest needs a metric name, got an empty one.")
        if self.mode not in ("min", "max"):
            raise ConfigurationError(f"mode must be 'min' or 'max', got {self.mode!r}.")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        scored = []
        for i, c in enumerate(ordered):
            value = c.metrics.get(self.metric)
            if value is None or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            scored.append((value if self.mode == "min" else -value, -i, i))
        scored.sort()
        return {i for _, _, i in scored[: self.count]}


@dataclass(frozen=True)
class KeepEverySeconds(RetentionPolicy):
    """Keep one checkpoint in every ``seconds``-long window of the clock: the first committed
    in each (windows start at multiples of ``seconds`` since the UNIX epoch, so
    ``seconds=3600`` keeps the first of every clock hour, the same one at every later save).
    """

    seconds: float

    def __post_init__(self) -> None:
        _check_seconds(self.seconds, "KeepEverySeconds seconds")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        first: dict[int, tuple[float, int]] = {}
        for i, c in enumerate(ordered):
            window = math.floor(c.created / self.seconds)
            if window not in first or (c.created, i) < first[window]:
                first[window] = (c.created, i)
        return {i for _, i in first.values()}


@dataclass(frozen=True)
class KeepRecent(RetentionPolicy):
    """Keep every checkpoint committed in the last ``seconds`` before ``now`` (one committed
    "in the future", by a clock ahead of this one, is kept too)."""

    seconds: float

    def __post_init__(self) -> None:
        _check_seconds(self.seconds, "KeepRecent seconds")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        if now is None:
            raise ConfigurationError("KeepRecent needs the time: pass now= (UNIX seconds).")
        return {i for i, c in enumerate(ordered) if c.created >= now - self.seconds}


@dataclass(frozen=True)
class AnyOf(RetentionPolicy):
    """Keep a checkpoint if any of ``policies`` keeps it."""

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if not isinstance(p, RetentionPolicy)]
        if bad or not self.policies:
            raise ConfigurationError(
                f"AnyOf takes one or more RetentionPolicy objects, got {self.policies!r}."
            )

    @override
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        keep: set[int] = set()
        for policy in self.policies:
            keep |= policy.kept(ordered, now)
        return keep

    @property
    @override
    def is_unlimited(self) -> bool:
        return any(p.is_unlimited for p in self.policies)

    @property
    @override
    def rules(self) -> tuple[RetentionPolicy, ...]:
        return tuple(rule for p in self.policies for rule in p.rules)


@dataclass(frozen=True)
class MaxTotalBytes(RetentionPolicy):
    """``policy``, and a byte budget for the whole checkpoints folder: :func:`plan_retention`
    deletes the oldest checkpoints ``policy`` keeps until everything listed fits in
    ``max_bytes`` (never the newest intact checkpoint, nor what accelkit did not write; if only
    those are left, the budget stays unmet and the plan says by how much).

    ``policy`` decides alone where no sizes are known (:func:`select_for_deletion`).
    """

    policy: RetentionPolicy
    max_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RetentionPolicy):
            raise ConfigurationError(f"MaxTotalBytes takes a RetentionPolicy, got {self.policy!r}.")
        _check_bytes(self.max_bytes, "MaxTotalBytes max_bytes")

    @override
    def kept(self, ordered: Sequence[RetentionCandidate], now: float | None = None) -> set[int]:
        return self.policy.kept(ordered, now)

    @property
    @override
    def is_unlimited(self) -> bool:
        return False

    @property
    @override
    def rules(self) -> tuple[RetentionPolicy, ...]:
        return (*self.policy.rules, self)


_FIELDS = (
    "keep_last",
    "keep_every",
    "keep_best",
    "metric",
    "mode",
    "keep_every_seconds",
    "keep_recent_seconds",
    "max_total_bytes",
)


def build_policy(
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    names: Mapping[str, str] | None = None,
    keep_every_seconds: float | None = None,
    keep_recent_seconds: float | None = None,
    max_total_bytes: int | None = None,
) -> RetentionPolicy:
    """The policy of these settings: the union of the rules set, :class:`KeepAll` if none,
    within :class:`MaxTotalBytes` if ``max_total_bytes`` is set.

    Args:
        keep_last: keep the newest N.
        keep_every: also keep every checkpoint whose iteration is a multiple of N.
        keep_best: also keep the best K by ``metric``.
        metric: the metric name for ``keep_best`` (given at save time).
        mode: ``"min"`` (lower is better) or ``"max"``.
        names: what the caller calls each setting, for error messages (e.g.
            ``{"keep_last": "total_limit"}`` or ``{"keep_last": "--keep"}``).
        keep_every_seconds: also keep the first checkpoint of every window of this many
            seconds (:class:`KeepEverySeconds`).
        keep_recent_seconds: also keep every checkpoint committed in the last this many
            seconds (:class:`KeepRecent`).
        max_total_bytes: the byte budget of the checkpoints folder (:class:`MaxTotalBytes`).

    Raises:
        ValueError: naming the bad setting: a count < 1 or not an int, ``keep_best`` without
            ``metric``, a bad ``mode``, seconds not > 0 or not finite, a byte budget < 1.

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
        raise ConfigurationError(
            f"{name['keep_best']} needs a metric name: set {name['metric']} to '<name>' and give "
            "that metric at save time (save_state(..., metrics={'<name>': value}))."
        )
    if mode not in ("min", "max"):
        raise ConfigurationError(f"{name['mode']} must be 'min' or 'max', got {mode!r}.")
    for field_name, seconds in (
        ("keep_every_seconds", keep_every_seconds),
        ("keep_recent_seconds", keep_recent_seconds),
    ):
        if seconds is not None:
            _check_seconds(seconds, name[field_name])
    if max_total_bytes is not None:
        _check_bytes(max_total_bytes, name["max_total_bytes"])
    rules: list[RetentionPolicy] = []
    if keep_last is not None:
        rules.append(KeepLast(keep_last))
    if keep_every is not None:
        rules.append(KeepEvery(keep_every))
    if keep_best is not None and metric:
        rules.append(KeepBest(keep_best, metric, mode))
    if keep_every_seconds is not None:
        rules.append(KeepEverySeconds(keep_every_seconds))
    if keep_recent_seconds is not None:
        rules.append(KeepRecent(keep_recent_seconds))
    policy: RetentionPolicy = KeepAll()
    if rules:
        policy = rules[0] if len(rules) == 1 else AnyOf(tuple(rules))
    return policy if max_total_bytes is None else MaxTotalBytes(policy, max_total_bytes)


def _order_key(candidate: RetentionCandidate) -> tuple[int, float, str]:
    iteration = candidate.iteration
    return (-1 if iteration is None else iteration, candidate.created, candidate.name)


def select_for_deletion(
    checkpoints: Sequence[C], policy: RetentionPolicy, now: float | None = None
) -> list[C]:
    """Return the checkpoints ``policy`` does not keep, oldest first.

    Age is the iteration, then the creation time (checkpoints without an iteration count as
    oldest). ``now`` is the time for :class:`KeepRecent`; a byte budget is not applied here
    (no sizes: see :func:`plan_retention`).

    Example:
        >>> select_for_deletion(ckpts, AnyOf((KeepLast(2), KeepEvery(10))))
    """
    if policy.is_unlimited:
        return []
    ordered = sorted(checkpoints, key=_order_key)
    keep = policy.kept(ordered, now)
    return [c for i, c in enumerate(ordered) if i not in keep]


@dataclass(frozen=True)
class RetentionPlan(Generic[C]):
    """What :func:`plan_retention` decided.

    Attributes:
        delete: the committed checkpoints to delete, oldest first: each one the policy does
            not keep, and those of :attr:`over_budget`.
        damaged: ``(checkpoint, why)`` for each one the check found damaged, oldest first:
            kept, never counted toward the policy (so an intact older one is kept in its
            place), never deleted.
        protected: the newest checkpoint that passed the check, when the policy alone would
            have deleted it (e.g. ``KeepEvery`` or ``KeepBest`` without ``KeepLast``); kept.
        intact: the newest checkpoint that passed the check, or ``None`` if none did (then no
            checkpoint is deleted at all).
        over_budget: the checkpoints of :attr:`delete` that the policy keeps but the byte
            budget (:class:`MaxTotalBytes`) removes, oldest first.
        over_by: how many bytes the folder still exceeds the budget by once the plan is
            carried out (``0``: it fits, or there is no budget): what is left is only what may
            not be deleted (the newest intact checkpoint, damaged, corrupt, foreign, named or
            spared ones, incomplete ones).
        incomplete: incomplete folders to delete (asked with ``remove_incomplete``): those
            older than the newest committed checkpoint (a newer one may be a save in flight).
    """

    delete: list[C] = field(default_factory=list)
    damaged: list[tuple[C, str]] = field(default_factory=list)
    protected: C | None = None
    intact: C | None = None
    over_budget: list[C] = field(default_factory=list)
    over_by: int = 0
    incomplete: list[C] = field(default_factory=list)


def plan_retention(
    checkpoints: Sequence[L],
    policy: RetentionPolicy,
    damage: Callable[[L], str | None],
    *,
    now: float | None = None,
    spare: Collection[str] = (),
    remove_incomplete: bool = False,
) -> RetentionPlan[L]:
    """Decide what to delete under a checkpoints folder, so that the project keeps a checkpoint
    that verifies: the one plan of training's retention and of ``accelkit ckpt prune``.

    Only committed ``checkpoint_<n>`` folders are counted by ``policy`` and deleted by it. Of
    those, ``damage(checkpoint)`` says why one cannot be trusted (``None``: intact). It is
    asked only about the checkpoints the plan keeps, newest first, each at most once: a
    damaged one leaves the candidates and the policy is applied again to the others, so it
    never counts toward ``KeepLast`` (the next older intact one is kept instead) and is never
    deleted. Then the newest checkpoint that passes is kept whatever the policy says. What is
    deleted was never asked about (it may be damaged; deleting it loses nothing).

    With a byte budget (:class:`MaxTotalBytes`), every folder listed counts toward it, and
    after the policy the oldest checkpoints it keeps are deleted until everything left fits:
    never the newest intact one, never one named in ``spare``, never a damaged one, never a
    folder that is not a committed ``checkpoint_<n>``.

    Args:
        checkpoints: every folder listed (see
            :func:`~accelkit.checkpointing.catalog.listing.list_checkpoints`), any state.
        policy: what to keep.
        damage: the check: ``accelkit ckpt prune`` compares checksums; training retention
            trusts the checkpoint it just wrote and the sizes the listing checked (see
            :func:`~accelkit.checkpointing.commit.deletion.apply_retention`).
        now: the time (UNIX seconds) for :class:`KeepRecent`; the caller's clock.
        spare: names never deleted (training: the checkpoint just committed).
        remove_incomplete: also plan the incomplete folders older than the newest committed
            checkpoint (``ckpt prune``; training leaves them).

    Returns:
        The plan; no committed checkpoint is deleted when ``policy`` keeps everything.

    Raises:
        ValueError: ``policy`` has a :class:`KeepRecent` rule and ``now`` is ``None``.

    Example:
        >>> plan = plan_retention(infos, KeepLast(1), lambda c: None, now=time.time())
    """
    listed = list(checkpoints)
    ordered = sorted(
        (c for c in listed if c.state == _COMMITTED and c.is_automatic), key=_order_key
    )
    stale = _stale_incomplete(listed, ordered) if remove_incomplete else []
    if policy.is_unlimited:
        return RetentionPlan(incomplete=stale)
    why: dict[int, str | None] = {}  # index in ordered -> the check's answer

    def check(i: int) -> bool:
        if i not in why:
            why[i] = damage(ordered[i])
        return why[i] is None

    while True:
        candidates = [i for i in range(len(ordered)) if why.get(i) is None]
        kept = {candidates[k] for k in policy.kept([ordered[i] for i in candidates], now)}
        unchecked = sorted((i for i in kept if i not in why), reverse=True)
        if not unchecked:
            break
        for i in unchecked:
            check(i)  # a damaged one leaves the candidates: apply the policy again
    doomed = [i for i in candidates if i not in kept and ordered[i].name not in spare]
    protected = intact = None
    for i in reversed(candidates):
        if check(i):  # the newest that passes, asked only if the policy would delete it
            intact = i
            if i in doomed:
                doomed.remove(i)
                protected = i
            break
    failed = _failed(why)
    doomed = [i for i in doomed if i not in failed]
    over: list[int] = []
    over_by = 0
    budget = policy.max_bytes if isinstance(policy, MaxTotalBytes) else None
    if budget is not None:
        gone = {id(ordered[i]) for i in doomed} | {id(c) for c in stale}
        total = sum(c.size_bytes for c in listed if id(c) not in gone)
        for i in candidates:  # oldest first
            if total <= budget:
                break
            if i in doomed or i == intact or i in failed or ordered[i].name in spare:
                continue
            over.append(i)
            total -= ordered[i].size_bytes
        over_by = max(0, total - budget)
    return RetentionPlan(
        delete=[ordered[i] for i in sorted(doomed + over)],
        damaged=[(ordered[i], str(why[i])) for i in sorted(failed)],
        protected=None if protected is None else ordered[protected],
        intact=None if intact is None else ordered[intact],
        over_budget=[ordered[i] for i in over],
        over_by=over_by,
        incomplete=stale,
    )


def _stale_incomplete(listed: Sequence[L], committed: Sequence[L]) -> list[L]:
    """The incomplete ``checkpoint_<n>`` folders older than the newest committed one."""
    newest = committed[-1].iteration if committed else None
    if newest is None:
        return []
    return sorted(
        (
            c
            for c in listed
            if c.state == _INCOMPLETE and c.iteration is not None and c.iteration < newest
        ),
        key=_order_key,
    )


def _failed(answers: Mapping[int, str | None]) -> set[int]:
    return {i for i, reason in answers.items() if reason is not None}
