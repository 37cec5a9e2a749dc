"""Experiment continuity: what connects a run's checkpoints and its tracker runs.

:class:`ExperimentLink` is the :class:`~accelkit.checkpointing.listener.CheckpointListener`
``Accelerator`` gives its checkpoint manager. It

- records, in every checkpoint's manifest (``experiment``), the run's last logging step, the
  checkpoint's own step on the trackers' axis (``saved_at_step``, where its events go: see
  :mod:`accelkit.trackers.events`; ``Accelerator.log`` goes through here to note where the
  script's steps stand against the optimizer steps), its run key (``key``) and each tracker's
  run reference, so ``accelkit ckpt ls`` can name the runs
  and a resumed job can continue them. The runs are named when the checkpoint is: a save never
  waits for a tracker's start-up (an MLflow server can take 10-20 s to open a run), and needs
  not to, since each tracker named its run from the run key before opening it
  (:meth:`GeneralTracker.name_run <accelkit.trackers.base.GeneralTracker.name_run>`). The
  manifest is written once, complete, and every tier's copy says the same, so a job killed at
  any moment after a save (before any backend answered) resumes into the same runs;
- on ``load_state``, hands those references and the run key back to the trackers
  (``continue_run`` before their runs open) and sets the step counter past the checkpoint's
  step, on every process, whichever of ``init_trackers`` and ``load_state`` came first
  (``ProjectConfiguration(continue_tracker_runs=False)`` turns this off). A checkpoint written
  before run keys may list trackers whose run was still opening in ``experiment.pending``:
  those trackers open new runs, with a warning;
- on ``load_state(..., fork=True)``, forks the checkpoint's runs instead (:meth:`TrackerHub.resume
  <accelkit.trackers.delivery.hub.TrackerHub.resume>`: new runs under a new run key, linked to
  the checkpoint's, whose step counter goes on past the checkpoint's step) and starts a new
  line of descent: every checkpoint this job saves records it (``experiment.lineage``: the
  checkpoint forked, its runs and steps), and a job resumed from one of them carries it on;
- queues a :class:`~accelkit.trackers.events.CheckpointEvent` for the trackers after each
  commit and each load (``ProjectConfiguration(checkpoint_events=False)`` turns this off).
  Only the hub's queues are touched here: the backends are called on their worker threads.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from accelkit.checkpointing.catalog.lineage import parent_record
from accelkit.checkpointing.formats.manifest import Manifest, lineage_of
from accelkit.checkpointing.listener import CommitReport, DropReport, LoadReport
from accelkit.checkpointing.replication import ReplicationReport
from accelkit.checkpointing.storage import basename
from accelkit.errors import UsageError
from accelkit.trackers import events
from accelkit.trackers.delivery.hub import TrackerHub
from accelkit.trackers.delivery.runs import new_run_key
from accelkit.training.optim import GradientState

__all__ = ["ExperimentLink"]


class ExperimentLink:
    """Connects a :class:`~accelkit.trackers.delivery.hub.TrackerHub` to a checkpoint manager.

    Args:
        hub: the run's trackers.
        continue_runs: continue the trackers' runs from a loaded checkpoint.
        checkpoint_events: tell the trackers about saves and loads.
        gradient_state: the run's accumulation state, whose optimizer steps place a
            checkpoint on the trackers' axis (:meth:`saved_at_step`); ``None``: at the last
            logged step.
    """

    def __init__(
        self,
        hub: TrackerHub,
        *,
        continue_runs: bool,
        checkpoint_events: bool,
        gradient_state: GradientState | None = None,
    ) -> None:
        self.hub = hub
        self.continue_runs = continue_runs
        self.checkpoint_events = checkpoint_events
        self.gradient_state = gradient_state
        # (step, optimizer steps taken) at this job's last log() with a step of the script's.
        self._last_log: tuple[int, int] | None = None
        # The manifest's experiment.lineage: where this run's state came from by a fork.
        self.lineage: dict[str, Any] = {}
        # The manifest's experiment.resumed: the tier and checkpoint this job last loaded.
        self.resumed: dict[str, Any] = {}

    def check_fork(self) -> None:
        """Before ``load_state(..., fork=True)``: refuse it once this run logged.

        Raises:
            UsageError: ``log()`` was called in this run already.
        """
        if self.hub.logging:
            raise UsageError(
                "load_state(fork=True) was called after this run logged: its tracker runs are "
                "open and cannot become new runs. Call load_state(path, fork=True) before the "
                "first accelerator.log() (right after init_trackers), or load without fork= "
                "to only restore the state."
            )

    def checkpoint_record(self) -> Mapping[str, Any]:
        """The manifest's ``experiment``: the last logging step, the run key and the
        trackers' runs (named without waiting for any backend), the lineage, and what this
        job last loaded."""
        lineage = {"lineage": self.lineage} if self.lineage else {}
        lineage |= {"resumed": self.resumed} if self.resumed else {}
        if not self.hub.requested_names:
            return lineage
        record: dict[str, Any] = {
            **lineage,
            "step": max(-1, self.hub.last_step),
            "saved_at_step": self.saved_at_step(),
            "runs": self.hub.references(),
        }
        if self.hub.run_key is not None:
            record["key"] = self.hub.run_key
        return record

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``Accelerator.log``: hand ``values`` to the hub (:meth:`TrackerHub.log
        <accelkit.trackers.delivery.hub.TrackerHub.log>`), noting where a script's own
        ``step`` stood against the optimizer steps (see :meth:`saved_at_step`)."""
        self.hub.log(values, step, log_kwargs)
        if self.gradient_state is not None:
            self._last_log = None if step is None else (int(step), self._optimizer_steps())

    def _optimizer_steps(self) -> int:
        return 0 if self.gradient_state is None else int(self.gradient_state.optimizer_steps)

    def saved_at_step(self) -> int:
        """Where a checkpoint saved now goes on the trackers' axis: the step its events are
        logged at (``experiment.saved_at_step``).

        That is the save's step, the optimizer steps taken (the manifest's ``step``), counted
        on the axis the script logs on. Before anything was logged: the optimizer steps
        taken. A script that logs with ``step=`` its optimizer step (at least the optimizer
        steps taken, less one: 0- or 1-based) saves at its last logged step plus the optimizer
        steps taken since, so that a script that logs once an epoch and saves every 10 steps
        sees its saves at 10, 20, 30. Any other axis (``step=epoch``, the hub's count of
        ``log()`` calls, no prepared optimizer): the last logged step, which is never ahead
        of that axis.
        """
        last = self.hub.last_step
        taken = self._optimizer_steps()
        if last < 0:
            return taken
        if self._last_log is None:  # log() without a step, or nothing logged since a resume
            return last
        step, taken_then = self._last_log
        if step == last and step >= taken_then - 1 and taken >= taken_then:
            return step + (taken - taken_then)
        return last

    def _step(self, manifest: Manifest) -> int:
        """A committed checkpoint's step on the trackers' axis (see :meth:`saved_at_step`;
        the last logged step in a manifest older than ``saved_at_step``)."""
        record = manifest.experiment
        return int(record.get("saved_at_step", record.get("step", self.hub.last_step)))

    def checkpoint_committed(self, report: CommitReport) -> None:
        """Queue a ``save`` event (called by the thread that committed)."""
        manifest = report.manifest
        if not self.checkpoint_events:
            return
        values = {
            events.SAVE_SECONDS: report.seconds,
            events.BLOCKING_SECONDS: report.blocking_seconds,
            events.BYTES: float(manifest.total_size),
            events.ITERATION: float(-1 if manifest.iteration is None else manifest.iteration),
        }
        if manifest.reason == "preemption":
            values[events.PREEMPTION] = 1.0
        event = events.CheckpointEvent(
            "save",
            max(0, self._step(manifest)),
            report.path,
            manifest.iteration,
            values,
            manifest.reason,
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
        self.hub.event(
            events.CheckpointEvent(
                "replicate",
                max(0, self._step(manifest)),
                report.replicated.target,
                manifest.iteration,
                values,
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
        self.hub.event(
            events.CheckpointEvent(
                "replicate", max(0, self._step(manifest)), report.path, manifest.iteration, values
            )
        )

    def checkpoint_loaded(self, report: LoadReport) -> None:
        """Continue (or fork) the checkpoint's runs, then queue a ``load`` event."""
        manifest = report.manifest
        name = basename(report.path)
        self.resumed = {"tier": report.tier, "checkpoint": name, "step": max(0, manifest.step)}
        record = manifest.experiment
        step = int(record.get("step", -1))
        resumed = False
        lineage = lineage_of(manifest)
        forks = report.fork or bool(lineage.get("start"))
        if report.fork:
            self.lineage = {"id": new_run_key(), "parent": parent_record(report.path, manifest)}
        elif forks:  # a copy by `accelkit ckpt fork`, where a line starts
            self.lineage = {"id": lineage.get("id") or new_run_key(), "parent": lineage["parent"]}
        else:
            self.lineage = lineage
        parent = self.lineage.get("parent")
        if forks and parent is not None:
            step = int(parent["step"])
            resumed = self.hub.resume(parent["runs"], step, self.lineage["id"], parent, fork=True)
        elif self.continue_runs and "runs" in record:
            runs = record.get("runs", {})
            # ``pending``: a checkpoint written before run keys, whose job ended before these
            # trackers' runs opened (today's checkpoints name every run when saved).
            lost = sorted(set(record.get("pending", [])) - set(runs))
            resumed = self.hub.resume(runs, step, record.get("key"), forked_from=parent)
            if resumed and lost:
                warnings.warn(
                    f"Checkpoint {report.path} was saved while the runs of {lost} were still "
                    "opening, and the job ended before their references were recorded: those "
                    "trackers open new runs (the others continue theirs). To continue a run "
                    "instead, load a checkpoint saved after it opened.",
                    stacklevel=2,
                )
        if not self.checkpoint_events:
            return
        saved_at = self._step(manifest) if "runs" in record and not forks else step
        values = {
            events.LOAD_SECONDS: report.seconds,
            events.RESUMED_STEP: float(step),
        }
        if resumed and saved_at > step:
            # The resume purges the points past the last logged step, the save's own point
            # at its step among them: this one takes its place. (Otherwise the save's point
            # is still there, with the iteration.)
            values[events.ITERATION] = float(
                -1 if manifest.iteration is None else manifest.iteration
            )
        self.hub.event(
            events.CheckpointEvent(
                "load",
                max(0, saved_at),
                report.path,
                manifest.iteration,
                values,
                manifest.reason,
                report.tier,
            )
        )
