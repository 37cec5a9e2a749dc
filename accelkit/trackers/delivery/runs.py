"""Which runs the hub's trackers open: `RunPlan`.

Each run has a key chosen by the hub (new at ``init``, the checkpoint's own when a job resumes
from one), handed to each tracker's ``name_run`` before its run opens, so that a checkpoint
names every run from the first save. A loaded checkpoint's runs and last step make the
trackers whose runs are not open yet ``continue_run`` before their ``start()`` (``fork_run``,
and a ``forked_from`` entry in their configuration, when the job forks the checkpoint: new
runs under a new key). Checkpoint events from before the runs opened are kept (a few) and
delivered right after they open.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Mapping
from typing import Any

from accelkit.errors import WrongTypeError
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.delivery.failures import FailurePolicy
from accelkit.trackers.delivery.items import Resume, Start
from accelkit.trackers.delivery.worker import Worker
from accelkit.trackers.events import CheckpointEvent

__all__ = ["FORKED_FROM", "RunPlan", "new_run_key", "references"]

_MAX_EARLY_EVENTS = 16

FORKED_FROM = "forked_from"
"""The configuration entry the runs of a forked line store (their trackers' runs, and those of
jobs resumed from its checkpoints): the checkpoint forked, as the manifest's
``experiment.lineage.parent`` records it (``{"checkpoint": <path or URL>, "iteration",
"step": <its last logging step>, "key": <its run key>, "runs": {<tracker>: <its run
reference>}}``, the keys known). The same for every tracker: those of one run may share a
folder (jsonl and TensorBoard both write ``config.json`` there)."""


class RunPlan:
    """The run key, the step counter, the loaded checkpoint's runs to continue, and the events
    kept until the runs open (the hub holds one; guarded by the hub's lock where threads meet).

    Attributes:
        key: the key of this run; ``None`` before ``init``.
        next_step: the step of the next ``log()`` called without one.
        logged: ``log()`` was called in this run (a later ``load_state`` is mid-run).
    """

    def __init__(self) -> None:
        self.key: str | None = None
        self.next_step = 0
        self.logged = False
        self.resume: tuple[Mapping[str, Any], int] | None = None  # a loaded checkpoint's runs
        self.resume_key: str | None = None  # and its run key
        self.forking = False  # forking those runs instead (new runs)
        self.forked: dict[str, Any] | None = None  # the FORKED_FROM entry of their config
        self.early: list[CheckpointEvent] = []  # events from before the runs opened

    def __getstate__(self) -> dict[str, Any]:
        """Without the kept events (they belong to the process whose trackers get them)."""
        return {**self.__dict__, "early": []}

    def begin(self) -> None:
        """A run begins (``init``): its key is the checkpoint's, or a new one; its steps
        count from 0, or from past the checkpoint's last step."""
        self.key = self.resume_key or new_run_key()
        self.next_step = 0 if self.resume is None else self.resume[1] + 1
        self.logged = False

    def advance(self, step: int | None) -> int:
        """The step of a ``log()`` call (``None``: the counter's); the counter moves past it.

        Raises:
            WrongTypeError: ``step`` is not an int (a ``TypeError``).
        """
        if step is None:
            step = self.next_step
        try:
            self.next_step = int(step) + 1
        except (TypeError, ValueError):
            raise WrongTypeError(
                f"log(step={step!r}): the step must be an int (the training step) or None "
                "(the hub counts the calls)."
            ) from None
        self.logged = True
        return step

    def end(self) -> None:
        """The run ended: a next one continues no checkpoint (until one is loaded)."""
        self.resume = self.resume_key = self.forked = None
        self.forking = False

    def continue_from(
        self,
        runs: Mapping[str, Any],
        step: int,
        key: str | None,
        *,
        named: bool,
        forked: Mapping[str, Any] | None = None,
        fork: bool = False,
    ) -> None:
        """Continue the runs a loaded checkpoint names (see :meth:`TrackerHub.resume
        <accelkit.trackers.delivery.hub.TrackerHub.resume>`), or with ``fork`` fork them
        into new runs under ``key``; ``forked``: the :data:`FORKED_FROM` entry of their
        configuration (the fork they descend from); ``named``: a run was named already, so
        it keeps its key."""
        self.resume = (dict(runs), int(step))
        self.forked = None if forked is None else dict(forked)
        self.forking = fork
        self.next_step = int(step) + 1
        if key is not None:
            self.resume_key = key
            if not named:
                self.key = key

    def keep(self, event: CheckpointEvent) -> None:
        """Keep an event from before the runs opened (the first few)."""
        if len(self.early) < _MAX_EARLY_EVENTS:
            self.early.append(event)

    def opening(
        self, worker: Worker, config: Mapping[str, Any] | None, policy: FailurePolicy
    ) -> functools.partial[Start]:
        """The ``Start`` item for ``worker``'s run (with the checkpoint's reference it
        continues), setting the run it plans: the checkpoint's, else the one the tracker's
        ``name_run`` names for the key."""
        named = self._name_run(worker, policy)
        resume: Resume | None = None
        if self.resume is not None:
            runs, step = self.resume
            reference = runs.get(worker.name)
            reference = dict(reference) if isinstance(reference, Mapping) else None
            resume = Resume(reference, step, fork=self.forking)
            if self.forked is not None:
                config = {**(config or {}), FORKED_FROM: self.forked}
        # The run it will open: the checkpoint's, if it continues one, else the key's.
        continued = None if resume is None or resume.fork else resume.reference
        worker.session.planned = continued or named
        return functools.partial(Start, config=config, resume=resume)

    def _name_run(self, worker: Worker, policy: FailurePolicy) -> dict[str, Any] | None:
        """The tracker's ``name_run(key)``: the reference of the run it is about to open."""
        if self.key is None:
            return None
        try:
            named = worker.tracker.name_run(self.key)
        except Exception as error:  # its run is then named once it opens
            policy.degraded(worker.name, f"name_run() failed ({type(error).__name__}: {error})")
            return None
        return None if named is None else dict(named)


def references(workers: list[Worker], timeout: float) -> dict[str, dict[str, Any]]:
    """Tracker name -> the reference of its run, for a checkpoint's manifest.

    A run still opening is named by what its tracker's ``name_run`` returned for the run key
    (or by the checkpoint's reference it is continuing), an open run by its
    ``run_reference()``: no wait for a backend. Only a tracker that records its runs but
    cannot name one before it opens (a ``run_reference`` without a ``name_run``: custom
    trackers written before run keys) is waited for, at most ``timeout`` seconds in all, so
    that its run is not left out. Failed trackers and those that name nothing are left out.
    """
    deadline = time.monotonic() + timeout
    for worker in workers:
        if worker.session.planned is None and _records_runs(worker.tracker):
            worker.session.opened.wait(max(0.0, deadline - time.monotonic()))
    found: dict[str, dict[str, Any]] = {}
    for worker in workers:
        session = worker.session
        reference = session.reference if session.reference is not None else session.planned
        if reference is not None and not session.failed:
            found[worker.name] = dict(reference)
    return found


def new_run_key() -> str:
    """A new run key: 32 lowercase hexadecimal digits (random), a valid W&B run id and Comet
    experiment key as it is."""
    return uuid.uuid4().hex


def _records_runs(tracker: GeneralTracker) -> bool:
    """Whether ``tracker`` records its runs in checkpoints (its own ``run_reference``)."""
    return type(tracker).run_reference is not GeneralTracker.run_reference
