"""Experiment continuity: what connects a run's checkpoints and its tracker runs.

:class:`ExperimentLink` is the :class:`~accelkit.checkpointing.listener.CheckpointListener`
``Accelerator`` gives its checkpoint manager. It

- records, in every checkpoint's manifest (``experiment``), the run's last logging step, the
  checkpoint's own step on the trackers' axis (``saved_at_step``, where its events go: see
  :mod:`accelkit.trackers.events`; ``Accelerator.log`` goes through here to note where the
  script's steps stand against the optimizer steps) and each tracker's run reference
  (:meth:`GeneralTracker.run_reference <accelkit.trackers.base.GeneralTracker.run_reference>`),
  so ``accelkit ckpt ls`` can name the runs and a resumed job can continue them. A save never
  waits for a tracker's start-up (an MLflow server can take 10-20 s to open a run): a tracker
  still opening its run is listed in ``experiment.pending``, and when its run opens a
  background thread rewrites the committed manifest atomically with the reference
  (:meth:`~accelkit.checkpointing.manager.CheckpointManager.complete_experiment`). The
  guarantee: once a tracker's run has opened, every checkpoint saved before that names it
  within one manifest write; ``wait_for_checkpoints()`` and ``end_training()`` wait for these
  writes (at most the trackers' ``timeout``). A process killed while a run is still opening
  leaves the checkpoint's ``pending`` entry: the resumed job opens a new run for that tracker
  and says so (no points were delivered to the run that never opened);
- on ``load_state``, hands those references back to the trackers (``continue_run`` before their
  runs open) and sets the step counter past the checkpoint's step, on every process, whichever
  of ``init_trackers`` and ``load_state`` came first (``ProjectConfiguration(
  continue_tracker_runs=False)`` turns this off);
- queues a :class:`~accelkit.trackers.events.CheckpointEvent` for the trackers after each
  commit and each load (``ProjectConfiguration(checkpoint_events=False)`` turns this off).
  Only the hub's queues are touched here: the backends are called on their worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.listener import CommitReport, DropReport, LoadReport
from accelkit.checkpointing.replication import ReplicationReport
from accelkit.trackers import events
from accelkit.trackers.hub import TrackerHub
from accelkit.training.optim import GradientState

__all__ = ["ExperimentLink"]

logger = logging.getLogger(__name__)

#: What completes a checkpoint's record: ``CheckpointManager.complete_experiment``.
Completer = Callable[[str, Mapping[str, Any]], bool]


class ExperimentLink:
    """Connects a :class:`~accelkit.trackers.hub.TrackerHub` to a checkpoint manager.

    Args:
        hub: the run's trackers.
        continue_runs: continue the trackers' runs from a loaded checkpoint.
        checkpoint_events: tell the trackers about saves and loads.
        complete: rewrites a committed checkpoint's record when a pending run reference
            arrives (``CheckpointManager.complete_experiment``); ``None``: saves wait for the
            runs to open instead.
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
        complete: Completer | None = None,
        gradient_state: GradientState | None = None,
    ) -> None:
        self.hub = hub
        self.continue_runs = continue_runs
        self.checkpoint_events = checkpoint_events
        self.complete = complete
        self.gradient_state = gradient_state
        # (step, optimizer steps taken) at this job's last log() with a step of the script's.
        self._last_log: tuple[int, int] | None = None
        self._completing: list[threading.Thread] = []
        self._guard = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the threads completing records (they belong to this process)."""
        state = self.__dict__.copy()
        state.update(_completing=[], _guard=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a copy made by :meth:`__getstate__`."""
        self.__dict__.update(state)
        self._guard = threading.Lock()

    def checkpoint_record(self) -> Mapping[str, Any]:
        """The manifest's ``experiment``: the last logging step, the trackers' runs, and
        (``pending``) the trackers whose run is still opening; never waits for them when
        ``complete`` is set."""
        if not self.hub.requested_names:
            return {}
        step = max(-1, self.hub.last_step)
        saved_at = self.saved_at_step()
        if self.complete is None:
            runs = self.hub.references()
            return {"step": step, "saved_at_step": saved_at, "runs": runs}
        runs = self.hub.references(wait=False)
        pending = sorted(set(self.hub.opening()) - set(runs))
        record: dict[str, Any] = {"step": step, "saved_at_step": saved_at, "runs": runs}
        if pending:
            record["pending"] = pending
        return record

    def _complete_later(self, path: str, pending: list[str]) -> None:
        """Start the thread that waits for ``pending``'s runs and completes ``path``'s record."""
        complete = self.complete
        assert complete is not None

        def run() -> None:
            try:
                found = self.hub.wait_opened(pending)
                if found:
                    complete(path, found)
                missing = sorted(set(pending) - set(found))
                if missing:
                    logger.warning(
                        "Checkpoint %s: the runs of %s did not open within %.0f s; its manifest "
                        "keeps them pending, and a job resumed from it opens new runs for them.",
                        path,
                        missing,
                        self.hub.timeout,
                    )
            except Exception:  # a storage error: the checkpoint itself is committed and whole
                logger.warning(
                    "Checkpoint %s: recording the runs of %s failed; a job resumed from it "
                    "opens new runs for them.",
                    path,
                    pending,
                    exc_info=True,
                )

        thread = threading.Thread(target=run, name="accelkit-experiment-record", daemon=True)
        with self._guard:
            self._completing = [t for t in self._completing if t.is_alive()] + [thread]
        thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the records of checkpoints saved while a run was opening are complete.

        Args:
            timeout: the most seconds to wait in all (default: the trackers' ``timeout``).

        Returns:
            ``True`` if every record was completed (or given up) in time.
        """
        limit = self.hub.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._guard:
            threads = list(self._completing)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``Accelerator.log``: hand ``values`` to the hub (:meth:`TrackerHub.log
        <accelkit.trackers.hub.TrackerHub.log>`), noting where a script's own ``step`` stood
        against the optimizer steps (see :meth:`saved_at_step`)."""
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
        """Complete the record later if a run was still opening; queue a ``save`` event
        (called by the thread that committed)."""
        manifest = report.manifest
        pending = manifest.experiment.get("pending")
        if pending and self.complete is not None:
            self._complete_later(report.path, list(pending))
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
        """Continue the checkpoint's runs, then queue a ``load`` event."""
        manifest = report.manifest
        record = manifest.experiment
        step = int(record.get("step", -1))
        resumed = False
        if self.continue_runs and record:
            runs = record.get("runs", {})
            lost = sorted(set(record.get("pending", [])) - set(runs))
            resumed = self.hub.resume(runs, step)
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
        saved_at = self._step(manifest) if record else step
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
                "load", max(0, saved_at), report.path, manifest.iteration, values, manifest.reason
            )
        )
