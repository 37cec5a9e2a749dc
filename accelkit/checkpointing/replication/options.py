"""``ReplicationOptions``: the remote tier's settings (``ProjectConfiguration.replication``).

They live in the room of their concern so that the remote tier
(:mod:`~accelkit.checkpointing.replication.tier`) reads them without importing the
configuration above it; :class:`~accelkit.checkpointing.ProjectConfiguration` holds one and
keeps the flat names (``replicate_to``, ``replicate_keep``...) as aliases of its fields.

Public API: :class:`ReplicationOptions`, :data:`RETENTION_SETTING_NAMES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accelkit.checkpointing.catalog.retention import RetentionPolicy, build_policy
from accelkit.errors import ConfigurationError

__all__ = ["RETENTION_SETTING_NAMES", "ReplicationOptions"]

#: The retention settings ``ReplicationOptions.keep`` takes, by the name
#: :func:`~accelkit.checkpointing.catalog.retention.build_policy` gives them -> the configuration's
#: name (the remote tier's retention runs without a clock or a byte budget).
RETENTION_SETTING_NAMES = {
    "keep_last": "total_limit",
    "keep_every": "keep_every",
    "keep_best": "keep_best",
    "metric": "best_metric",
    "mode": "best_mode",
}


@dataclass
class ReplicationOptions:
    """A second, remote tier for a run's automatic checkpoints (see
    ``docs/guides/replication.md``). Each field is also a flat keyword of
    ``ProjectConfiguration``: ``replicate_<field>``.

    Args:
        to: the remote tier (any fsspec URL, ``s3://bucket/run``; reached with the
            configuration's ``storage_options``). Each committed automatic checkpoint under
            ``project_dir`` (the local tier) is copied there by a background thread, its
            manifest written last; a storage outage is retried, never fatal. ``None`` (the
            default): no remote tier.
        keep: retention on the remote tier: ``None`` keeps every replicated checkpoint; an int
            keeps the newest N; a mapping takes the local settings' names (``{"total_limit": 5,
            "keep_every": 1000, "keep_best": 2, "best_metric": "loss", "best_mode": "min"}``),
            with the same rules.
        deadline_seconds: how long ``end_training()`` (and interpreter exit) waits for the
            replication queue to drain; what is left is named in a warning, and the process
            exits without waiting for an upload in flight. Once a preemption signal arrived,
            ``preemption_seconds`` holds instead.
        queue_size: checkpoints waiting for replication beyond the one in flight; when the
            queue is full, intermediate ones are skipped (never the newest, never one the
            remote retention keeps).
        local_budget_bytes: the most bytes of local checkpoints that local retention holds
            back because they are not replicated yet (``None``, the default: no limit besides
            ``queue_size``). Retention keeps a checkpoint it would delete until it reaches the
            remote tier; with the remote tier down, those pile up on the local disk. When they
            would exceed this budget, the oldest of them is deleted anyway (never the newest
            checkpoint, never one whose copy is in flight) and that is said once per
            checkpoint: a warning naming it and a ``checkpoint/replication_dropped`` tracker
            event. ``0`` holds nothing back.
        preemption_seconds: with preemption signals, how long a preemption exit waits for the
            checkpoints still queued (its own included) to reach the remote tier before the
            process exits; the log says whether they did. ``end_training()`` keeps to it too
            once a preemption signal arrived. Keep it inside the grace period (see
            ``docs/guides/preemption.md``).
    """

    to: str | None = None
    keep: int | Mapping[str, Any] | None = None
    deadline_seconds: float = 300.0
    queue_size: int = 4
    local_budget_bytes: int | None = None
    preemption_seconds: float = 60.0

    def retention_policy(self) -> RetentionPolicy:
        """The retention policy of the remote tier, from :attr:`keep`.

        Raises:
            ValueError: naming the bad key or value of ``replicate_keep``.
        """
        keep = self.keep
        if keep is None:
            settings: dict[str, Any] = {}
        elif isinstance(keep, bool) or not isinstance(keep, (int, Mapping)):
            raise ConfigurationError(
                f"ProjectConfiguration: replicate_keep must be None, an int (keep the newest N) "
                f"or a mapping with keys {', '.join(RETENTION_SETTING_NAMES.values())}; got "
                f"{keep!r}."
            )
        elif isinstance(keep, int):
            settings = {"keep_last": keep}
        else:
            reverse = {v: k for k, v in RETENTION_SETTING_NAMES.items()}
            unknown = sorted(str(k) for k in keep if k not in reverse)
            if unknown:
                raise ConfigurationError(
                    f"ProjectConfiguration: replicate_keep has unknown keys {unknown}; valid "
                    f"keys: {', '.join(RETENTION_SETTING_NAMES.values())}."
                )
            settings = {reverse[k]: v for k, v in keep.items()}
        names = {k: f"replicate_keep[{v!r}]" for k, v in RETENTION_SETTING_NAMES.items()}
        if isinstance(keep, int):
            names["keep_last"] = "replicate_keep"
        try:
            return build_policy(
                keep_last=settings.get("keep_last"),
                keep_every=settings.get("keep_every"),
                keep_best=settings.get("keep_best"),
                metric=settings.get("metric"),
                mode=settings.get("mode", "min"),
                names=names,
            )
        except ValueError as exc:
            raise ConfigurationError(f"ProjectConfiguration: {exc}") from None
