"""Checkpoint events: what a tracker is told when a checkpoint is saved, loaded or replicated.

``Accelerator.save_state`` and ``load_state`` hand one :class:`CheckpointEvent` to every tracker
of the run through the hub, so the backend call runs on the tracker's own worker thread, never
on the training thread (for an asynchronous save the event is queued by the writer thread,
after the commit). Each tracker receives it in :meth:`GeneralTracker.on_checkpoint
<accelkit.trackers.base.GeneralTracker.on_checkpoint>`; the default logs :attr:`CheckpointEvent.
values` at :attr:`CheckpointEvent.step` like any other values.

The values (numbers), by event kind:

========================== ==========================================================
``checkpoint/save_seconds``   save: from the ``save_state`` call to the commit
``checkpoint/blocking_seconds`` save: how long ``save_state`` blocked the training loop
                              (the whole save when synchronous)
``checkpoint/bytes``          save: total size of the checkpoint's files
``checkpoint/iteration``      save: the checkpoint's number (``-1`` without one); load too,
                              where the resume dropped the save's own point
``checkpoint/preemption``     save: ``1`` on a checkpoint made for a preemption signal
                              (only then; :attr:`CheckpointEvent.reason` names every reason)
``checkpoint/load_seconds``   load: from the ``load_state`` call to the restored state
``checkpoint/resumed_step``   load: the logging step the run continues after (the last one
                              logged before the save)
``checkpoint/replication_seconds`` replicate: how long the copy to the remote tier took
``checkpoint/replication_lag_seconds`` replicate: from the local commit to the remote commit
``checkpoint/replication_queued`` replicate: checkpoints still waiting for the remote tier
``checkpoint/replication_dropped`` replicate: ``1`` when the local disk budget
                              (``replicate_local_budget_bytes``) deleted this checkpoint
                              before it reached the remote tier (its path is the event's)
========================== ==========================================================

The step of an event is the checkpoint's step on the axis the script logs on (its manifest's
``experiment.saved_at_step``): the save's optimizer steps (the manifest's ``step``) as the
script counts them. A script that logs with ``step=`` its optimizer step (0- or 1-based) sees
each save at the step it was made, however long ago it last logged: the last logged step plus
the optimizer steps taken since. Before anything was logged, the optimizer steps taken. On any
other axis (``step=epoch``, ``log()`` without a step, no prepared optimizer) the last step
given to ``Accelerator.log`` before the save, which is never ahead of that axis.

A job resumed from a checkpoint drops the points logged after it was saved: those after the
last step logged before the save (``experiment.step``), whatever the axis, so that no point
is kept twice. Where the save's own point was past that step, the ``load`` event takes its
place, with its ``checkpoint/iteration``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "BLOCKING_SECONDS",
    "BYTES",
    "ITERATION",
    "LOAD_SECONDS",
    "PREEMPTION",
    "REPLICATION_DROPPED",
    "REPLICATION_LAG",
    "REPLICATION_QUEUED",
    "REPLICATION_SECONDS",
    "RESUMED_STEP",
    "SAVE_SECONDS",
    "CheckpointEvent",
]

SAVE_SECONDS = "checkpoint/save_seconds"
BLOCKING_SECONDS = "checkpoint/blocking_seconds"
BYTES = "checkpoint/bytes"
ITERATION = "checkpoint/iteration"
PREEMPTION = "checkpoint/preemption"
LOAD_SECONDS = "checkpoint/load_seconds"
RESUMED_STEP = "checkpoint/resumed_step"
REPLICATION_SECONDS = "checkpoint/replication_seconds"
REPLICATION_LAG = "checkpoint/replication_lag_seconds"
REPLICATION_QUEUED = "checkpoint/replication_queued"
REPLICATION_DROPPED = "checkpoint/replication_dropped"


@dataclass(frozen=True)
class CheckpointEvent:
    """One checkpoint saved (committed) or loaded.

    Attributes:
        kind: ``"save"``, ``"load"`` or ``"replicate"`` (the checkpoint reached the remote
            tier of ``ProjectConfiguration.replicate_to``).
        step: the checkpoint's step (see the module's docstring; ``0`` when it has none).
        path: the checkpoint's folder or URL.
        iteration: the checkpoint's number, ``None`` for a folder named by the caller.
        values: the numbers of the event, by the names in this module's table.
        reason: why the checkpoint was made (its manifest's ``reason``: ``"user"``,
            ``"interval"``, ``"preemption"``, or ``"memory"`` for a memory snapshot a run
            resumed from).
        tier: for a load, where the checkpoint came from: ``"memory"`` (the job's memory
            snapshots), ``"local"`` (the project's checkpoints), ``"remote"`` (the remote tier
            of ``replicate_to``) or ``"path"`` (a folder the script named); ``None`` otherwise.
    """

    kind: Literal["save", "load", "replicate"]
    step: int
    path: str
    iteration: int | None = None
    values: Mapping[str, float] = field(default_factory=dict)
    reason: str = "user"
    tier: str | None = None

    @property
    def name(self) -> str:
        """The checkpoint's folder name (the last component of :attr:`path`)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def journal_fields(self) -> dict[str, Any]:
        """What the tracker journal keeps of the event besides its step and values (read
        back by :meth:`from_journal`)."""
        fields = {"kind": self.kind, "path": self.path, "iteration": self.iteration}
        fields["reason"] = self.reason
        if self.tier is not None:
            fields["tier"] = self.tier
        return fields

    @classmethod
    def from_journal(
        cls, step: int, values: Mapping[str, Any], fields: Mapping[str, Any]
    ) -> CheckpointEvent:
        """The event a journal entry holds (its step, values and :meth:`journal_fields`), as
        sent after a restart. A field of another type (a damaged or older journal) reads as
        its default: the event is still delivered."""
        kind = fields.get("kind")
        iteration, reason, tier = fields.get("iteration"), fields.get("reason"), fields.get("tier")
        return cls(
            kind if kind in ("save", "load", "replicate") else "save",
            step,
            str(fields.get("path", "")),
            iteration if type(iteration) is int else None,
            {
                str(k): float(v)
                for k, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            },
            reason if isinstance(reason, str) else "user",
            tier if isinstance(tier, str) else None,
        )
