"""Retention: which committed checkpoints to delete. A pure function, no I/O.

Public API:

- :class:`RetentionPolicy` -- ``keep_last`` (``ProjectConfiguration.total_limit``: the newest N),
  ``keep_every`` (every checkpoint whose iteration is a multiple of N), ``keep_best`` with
  ``metric`` and ``mode`` (``"min"``/``"max"``: the best K by a metric given at save time).
  Rules combine as a union: a checkpoint is kept if any rule keeps it. A policy with no rule
  keeps everything.
- :func:`select_for_deletion(checkpoints, policy) <select_for_deletion>` -- the checkpoints to
  delete, oldest first. Inputs are any objects with ``name``, ``iteration`` (int or ``None``),
  ``created`` (float) and ``metrics`` (mapping) -- e.g. :class:`~accelkit.checkpointing.catalog.
  CheckpointInfo` -- and must be *committed* checkpoints only: the caller never passes
  incomplete folders or stray ones such as ``checkpoints/best``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["RetentionCandidate", "RetentionPolicy", "select_for_deletion"]


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


@dataclass(frozen=True)
class RetentionPolicy:
    """Which checkpoints to keep.

    Args:
        keep_last: keep the newest N (``total_limit``); ``None`` for no limit from this rule.
        keep_every: also keep every checkpoint whose iteration is a multiple of N.
        keep_best: also keep the best K by ``metric``.
        metric: the metric name for ``keep_best`` (given at save time).
        mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"``.

    Raises:
        ValueError: for a count < 1, ``keep_best`` without ``metric``, or a bad ``mode``.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}.")
            if value is not None and value < 1:
                raise ValueError(
                    f"{name} must be >= 1 or None, got {value}. Use None to disable this rule."
                )
        if self.keep_best is not None and not self.metric:
            raise ValueError(
                "keep_best needs a metric name: pass metric='<name>' and give that metric at "
                "save time (save_state(..., metrics={'<name>': value}))."
            )
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}.")

    @property
    def is_unlimited(self) -> bool:
        """True when no rule is set: nothing is ever deleted."""
        return self.keep_last is None and self.keep_every is None and self.keep_best is None


def _order_key(candidate: RetentionCandidate) -> tuple[int, float, str]:
    iteration = candidate.iteration
    return (-1 if iteration is None else iteration, candidate.created, candidate.name)


def select_for_deletion(checkpoints: Sequence[C], policy: RetentionPolicy) -> list[C]:
    """Return the checkpoints ``policy`` does not keep, oldest first.

    Age is the iteration, then the creation time (checkpoints without an iteration count as
    oldest). Checkpoints lacking the ``keep_best`` metric, or whose value is NaN, are never
    among the best but may be kept by another rule.

    Example:
        >>> select_for_deletion(ckpts, RetentionPolicy(keep_last=2, keep_every=10))
    """
    if policy.is_unlimited:
        return []
    ordered = sorted(checkpoints, key=_order_key)
    keep: set[int] = set()
    if policy.keep_last is not None:
        keep.update(range(max(0, len(ordered) - policy.keep_last), len(ordered)))
    if policy.keep_every is not None:
        every = policy.keep_every
        keep.update(
            i for i, c in enumerate(ordered) if c.iteration is not None and c.iteration % every == 0
        )
    if policy.keep_best is not None and policy.metric is not None:
        metric = policy.metric
        scored = []
        for i, c in enumerate(ordered):
            value = c.metrics.get(metric)
            if value is None or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            scored.append((value if policy.mode == "min" else -value, -i, i))
        scored.sort()
        keep.update(i for _, _, i in scored[: policy.keep_best])
    return [c for i, c in enumerate(ordered) if i not in keep]
