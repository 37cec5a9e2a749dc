"""Experiment continuity: what connects a run's checkpoints and its tracker runs.

:class:`ExperimentLink` is the :class:`~accelkit.checkpointing.listener.CheckpointListener`
``Accelerator`` gives its checkpoint manager. It

- records, in every checkpoint's manifest (``experiment``), the run's last logging step and
  each tracker's run reference (:meth:`GeneralTracker.run_reference
  <accelkit.trackers.base.GeneralTracker.run_reference>`), so ``accelkit ckpt ls`` can name the
  runs and a resumed job can continue them;
- on ``load_state``, hands those references back to the trackers (``continue_run`` before their
  runs open) and sets the step counter past the checkpoint's step, on every process, whichever
  of ``init_trackers`` and ``load_state`` came first (``ProjectConfiguration(
  continue_tracker_runs=False)`` turns this off);
- queues a :class:`~accelkit.trackers.events.CheckpointEvent` for the trackers after each
  commit and each load (``ProjectConfiguration(checkpoint_events=False)`` turns this off).
  Only the hub's queues are touched here: the backends are called on their worker threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelkit.checkpointing.listener import CommitReport, DropReport, LoadReport
from accelkit.checkpointing.replication import ReplicationReport
from accelkit.trackers import events
from accelkit.trackers.hub import TrackerHub

__all__ = ["ExperimentLink"]


class ExperimentLink:
    """Connects a :class:`~accelkit.trackers.hub.TrackerHub` to a checkpoint manager.

    Args:
        hub: the run's trackers.
        continue_runs: continue the trackers' runs from a loaded checkpoint.
        checkpoint_events: tell the trackers about saves and loads.
    """

    def __init__(self, hub: TrackerHub, *, continue_runs: bool, checkpoint_events: bool) -> None:
        self.hub = hub
        self.continue_runs = continue_runs
        self.checkpoint_events = checkpoint_events

    def checkpoint_record(self) -> Mapping[str, Any]:
        """The manifest's ``experiment``: the last logging step and the trackers' runs."""
        if not self.hub.requested_names:
            return {}
        return {"step": max(-1, self.hub.last_step), "runs": self.hub.references()}

    def checkpoint_committed(self, report: CommitReport) -> None:
        """Queue a ``save`` event (called by the thread that committed)."""
        if not self.checkpoint_events:
            return
        manifest = report.manifest
        values = {
            events.SAVE_SECONDS: report.seconds,
            events.BLOCKING_SECONDS: report.blocking_seconds,
            events.BYTES: float(manifest.total_size),
            events.ITERATION: float(-1 if manifest.iteration is None else manifest.iteration),
        }
        if manifest.reason == "preemption":
            values[events.PREEMPTION] = 1.0
        step = manifest.experiment.get("step", self.hub.last_step)
        event = events.CheckpointEvent(
            "save", max(0, step), report.path, manifest.iteration, values, manifest.reason
        )
        self.hub.event(event)

    def checkpoint_replicated(self, report: ReplicationReport) -> None:
        """Queue a ``replicate`` event (called by the replicator's thread)."""
        if not self.checkpoint_events:
            return
        manifest = report.replicated.manifest
        values = {
            events.REPLICATION_SECONDS: report.replicated.seconds,
            events.REPLICATION_LAG: report.lag_seconds,
            events.REPLICATION_QUEUED: float(report.queued),
        }
        step = manifest.experiment.get("step", self.hub.last_step)
        self.hub.event(
            events.CheckpointEvent(
                "replicate", max(0, step), report.replicated.target, manifest.iteration, values
            )
        )

    def checkpoint_dropped(self, report: DropReport) -> None:
        """Queue a ``replicate`` event with ``checkpoint/replication_dropped`` = 1: the disk
        budget deleted this checkpoint before it reached the remote tier."""
        if not self.checkpoint_events:
            return
        manifest = report.manifest
        values = {
            events.REPLICATION_DROPPED: 1.0,
            events.BYTES: float(report.size_bytes),
        }
        step = manifest.experiment.get("step", self.hub.last_step)
        self.hub.event(
            events.CheckpointEvent(
                "replicate", max(0, step), report.path, manifest.iteration, values
            )
        )

    def checkpoint_loaded(self, report: LoadReport) -> None:
        """Continue the checkpoint's runs, then queue a ``load`` event."""
        manifest = report.manifest
        record = manifest.experiment
        step = int(record.get("step", -1))
        if self.continue_runs and record:
            self.hub.resume(record.get("runs", {}), step)
        if not self.checkpoint_events:
            return
        values = {
            events.LOAD_SECONDS: report.seconds,
            events.RESUMED_STEP: float(step),
        }  # no ITERATION: the save's event already put that point at this step
        self.hub.event(
            events.CheckpointEvent(
                "load", max(0, step), report.path, manifest.iteration, values, manifest.reason
            )
        )
