"""The background replicator: a bounded queue and one thread copying committed checkpoints.

A save commits to the local tier and returns; the manager then hands the committed checkpoint to
:meth:`Replicator.submit`. One thread copies it with
:func:`~accelkit.checkpointing.replication.copy.replicate_checkpoint` under the remote tier's
run lock (:class:`~accelkit.checkpointing.commit.lock.RunLock`), then applies the remote
retention policy under the same lock (deletions as ``accelkit ckpt prune`` makes them).

**Outages.** Transient errors are retried with exponential backoff and jitter for as long as
the run lasts (:class:`~accelkit.delivery.retry.RetryPolicy` with no deadline); a
hard error (credentials, missing bucket, permission) stops replication and is reported once,
with the fix. Training is never interrupted by either.

**Queue policy.** The queue holds at most ``queue_size`` checkpoints besides the one in flight.
When it falls behind:

- a waiting checkpoint that the remote retention would delete anyway, once the newer ones are
  there, is skipped (its local copy is then no longer held back from local retention);
- if the queue is still over its size, the oldest waiting checkpoints are skipped;
- the newest checkpoint is never skipped, and the next one copied is always the newest waiting.

A checkpoint skipped because the queue is full is one the remote tier will lack: that is said
once, as a warning naming it, the reason and the command that copies it later (local retention
no longer holds it back, so it may leave the local tier too). The end-of-run summary
(:meth:`Replicator.close`) names it again, with what became of it: still committed locally
(``accelkit ckpt sync`` copies it), or deleted from the local tier without ever reaching the
remote one (retention, or the disk budget below). A checkpoint the remote retention would
delete anyway is skipped with an info line: the remote tier was never meant to keep it.

**Disk budget.** Local retention holds back the checkpoints queued or in flight
(:meth:`Replicator.unreplicated`); with ``replicate_local_budget_bytes`` it may release the
oldest queued ones (:meth:`Replicator.release`, never the one in flight) and delete them, each
named once (see :class:`~accelkit.checkpointing.commit.deletion.HoldBudget`).

**Its parts.** :class:`Replicator` is the thread (start, drain, close, failures reported
once); its queue holds the jobs and applies the policy above (guarded by the thread's condition);
what the thread does to the remote tier for one checkpoint (the copy and the remote retention
under the remote run lock, the listing) is
:class:`~accelkit.checkpointing.replication.remote.RemoteWriter`, and the local project's record
of its remote tier (``accelkit ckpt ls``'s TIER and LAG columns) is
:class:`~accelkit.checkpointing.replication.record.TierBook`, written when the thread starts,
after each remote commit and when the remote listing changes (a failure to write it is logged
once, never fatal).

**Shutdown.** :meth:`Replicator.close` waits for the queue to drain up to a deadline and names
what it leaves behind (``accelkit ckpt sync`` copies it later); the manager calls it from
``end_training()`` and at interpreter exit.

Public API: :class:`Replicator`, :class:`ReplicationReport`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelkit.checkpointing.catalog.listing import (
    CheckpointInfo,
    committed_automatic,
    list_checkpoints,
)
from accelkit.checkpointing.catalog.retention import RetentionPolicy, select_for_deletion
from accelkit.checkpointing.formats.layout import (
    MANIFEST_NAME,
    checkpoints_dir,
    parse_checkpoint_name,
)
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.replication.copy import Replicated, same_checkpoint
from accelkit.checkpointing.replication.record import TierBook
from accelkit.checkpointing.replication.remote import RemoteWriter
from accelkit.checkpointing.storage import Storage, join, protocol_of
from accelkit.checkpointing.storage.retry import hard_error_fix
from accelkit.delivery import HARD, TRANSIENT, Deadline, RetryPolicy, classify, drain

__all__ = ["UPLOAD_PART", "ReplicationReport", "Replicator", "remote_options"]

logger = logging.getLogger(__name__)

UPLOAD_PART = 8 * 1024 * 1024
"""The block size of s3fs's own file objects on the replicator's S3 filesystem (s3fs's
``default_block_size``; its default, 50 MiB, would be buffered per file object). The
checkpoint files themselves are uploaded in accelkit's own 16 MiB parts, at most
:data:`~accelkit.checkpointing.replication.copy.UPLOAD_PARTS_IN_FLIGHT` in flight."""


def remote_options(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options the replicator opens ``url`` with: ``options``, plus
    :data:`UPLOAD_PART` as s3fs's block size unless ``options`` sets one."""
    out = dict(options)
    if protocol_of(url) in ("s3", "s3a"):
        out.setdefault("default_block_size", UPLOAD_PART)
    return out


START_GRACE_S = 0.2
"""A queued checkpoint waits this long before its copy starts, so that the save which queued
it returns before the upload competes with it for the CPU."""

FOREVER = RetryPolicy(base_delay=0.5, max_delay=15.0, deadline=None)
"""The replicator's default retries: keep trying while the run lasts."""


@dataclass(frozen=True)
class ReplicationReport:
    """One checkpoint that reached the remote tier.

    Attributes:
        replicated: what the copy did (paths, bytes, files, seconds).
        lag_seconds: from the local commit (the manifest's ``created``) to the remote commit.
        queued: checkpoints still waiting after this one.
    """

    replicated: Replicated
    lag_seconds: float
    queued: int


@dataclass
class _Job:
    name: str
    path: str
    manifest: Manifest
    iteration: int
    queued_at: float = field(default_factory=time.monotonic)

    # RetentionCandidate, for the queue policy
    @property
    def created(self) -> float:
        return self.manifest.created

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.manifest.metrics)


@dataclass
class _Queue:
    """The replicator's jobs and the queue policy (the module docstring); the replicator's
    condition guards it."""

    policy: RetentionPolicy
    size: int
    sync_command: str
    pending: dict[str, _Job] = field(default_factory=dict)
    in_flight: _Job | None = None
    done: set[str] = field(default_factory=set)
    skipped: dict[str, tuple[_Job, str]] = field(default_factory=dict)
    """Skipped jobs that the remote tier was meant to keep, with the reason."""
    dropped: list[str] = field(default_factory=list)
    failed: dict[str, _Job] = field(default_factory=dict)
    remote: list[CheckpointInfo] = field(default_factory=list)

    def add(self, job: _Job) -> None:
        """Queue ``job`` (again, if it was skipped) and apply the queue policy."""
        self.skipped.pop(job.name, None)
        self.pending[job.name] = job
        self._trim()

    def unreplicated(self) -> list[_Job]:
        """The jobs queued or in flight."""
        jobs = list(self.pending.values())
        if self.in_flight is not None:
            jobs.append(self.in_flight)
        return jobs

    def release(self, path: str) -> bool:
        """Skip the queued checkpoint ``path`` for the disk budget (``Replicator.release``)."""
        for name, job in self.pending.items():
            if job.path.rstrip("/") == path:
                # HoldBudget names the deletion itself (a warning): no second line here.
                self._skip(
                    name,
                    "the local disk budget deleted it (replicate_local_budget_bytes)",
                    quiet=True,
                )
                self.dropped.append(name)
                return True
        return False

    def left(self) -> list[str]:
        """Names queued, in flight or failed, oldest first."""
        jobs = self.unreplicated() + list(self.failed.values())
        return [job.name for job in sorted(jobs, key=lambda j: j.iteration)]

    def _trim(self) -> None:
        """Apply the queue policy (under the condition's lock)."""
        pending = self.pending
        if len(pending) <= 1:
            return
        newest = max(pending.values(), key=lambda j: j.iteration).name
        known: list[CheckpointInfo | _Job] = [*self.remote]
        names = {info.name for info in known}
        known += [job for job in pending.values() if job.name not in names]
        known.sort(key=lambda c: (c.iteration or 0, c.created))
        doomed = {c.name for c in select_for_deletion(known, self.policy)}
        for name in sorted(pending, key=lambda n: pending[n].iteration):
            if name != newest and name in doomed:
                self.pending.pop(name)
                logger.info(
                    "Replication skips %s: the remote retention policy would delete it once "
                    "newer ones are there; a newer checkpoint is queued.",
                    name,
                )
        while len(pending) > self.size:
            oldest = min(
                (j for j in pending.values() if j.name != newest), key=lambda j: j.iteration
            )
            self._skip(
                oldest.name,
                f"the replication queue was full (replicate_queue_size={self.size})",
            )

    def _skip(self, name: str, why: str, quiet: bool = False) -> None:
        """Take ``name`` off the queue although the remote tier was meant to keep it: said once
        (unless the caller says it), and named again by :meth:`Replicator.close`."""
        job = self.pending.pop(name)
        self.skipped[name] = (job, why)
        if not quiet:
            logger.warning(
                "Replication skips %s: %s; it is not replicated by this run (a newer checkpoint "
                "is queued). It is committed on the local tier only, where retention no longer "
                "holds it back; while it is there, `%s` copies it.",
                name,
                why,
                self.sync_command,
            )


class Replicator:
    """Copies committed checkpoints of a local project to a remote one, in one thread.

    Args:
        local: the storage of the local tier.
        local_project: the local ``project_dir``.
        remote: the storage of the remote tier (its errors are classified and retried here).
        remote_project: ``replicate_to``.
        policy: retention on the remote tier (``KeepAll`` keeps everything).
        queue_size: checkpoints waiting besides the one in flight (see the module docstring).
        retry: the backoff of transient errors (default: keep trying).
        on_replicated: called (in the thread) after each checkpoint reached the remote tier;
            its failures are logged.
    """

    def __init__(
        self,
        local: Storage,
        local_project: str,
        remote: Storage,
        remote_project: str,
        policy: RetentionPolicy,
        queue_size: int = 4,
        retry: RetryPolicy = FOREVER,
        on_replicated: Callable[[ReplicationReport], None] | None = None,
    ) -> None:
        self.local = local
        self.local_project = local_project
        self.local_root = checkpoints_dir(local_project)
        self.remote = remote
        self.remote_project = remote_project
        self.remote_root = checkpoints_dir(remote_project)
        self.policy = policy
        self.queue_size = queue_size
        self.retry = retry
        self.on_replicated = on_replicated
        self.failure: BaseException | None = None
        """The hard error that stopped replication, if any."""
        self._cond = threading.Condition()
        self._queue = _Queue(policy, queue_size, self.sync_command())
        self._stop = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._scanned = False
        self._book = TierBook(local, local_project, remote_project)
        self._writer = RemoteWriter(
            local, remote, remote_project, policy, retry, self._book, self._stop
        )

    # ------------------------------------------------------------------ the training side

    def start(self, catch_up: bool = True) -> None:
        """Start the thread (once); with ``catch_up``, it first queues the local committed
        checkpoints the remote tier lacks (a run that ended before its queue drained, or
        was killed in the middle of an upload)."""
        with self._cond:
            if self._thread is not None:
                return
            self._scanned = not catch_up
            self._thread = threading.Thread(
                target=self._run, name="accelkit-replicator", daemon=True
            )
            self._thread.start()

    def submit(self, path: str, manifest: Manifest) -> None:
        """Queue the committed checkpoint ``path`` (a ``checkpoint_<n>`` of the local tier)."""
        name = path.rstrip("/").rsplit("/", 1)[-1]
        iteration = parse_checkpoint_name(name)
        if iteration is None:
            return
        with self._cond:
            if name in self._queue.done:
                return
            job = _Job(name, path, manifest, iteration)
            if self.failure is not None:  # stopped by a hard error: named as left behind
                self._queue.failed[name] = job
                return
            self._queue.add(job)
            self._cond.notify_all()

    def unreplicated(self) -> set[str]:
        """Paths of local checkpoints queued or in flight (local retention keeps them)."""
        with self._cond:
            return {job.path.rstrip("/") for job in self._queue.unreplicated()}

    def release(self, path: str) -> bool:
        """Drop the queued checkpoint ``path`` so that local retention may delete it (the disk
        budget forces it out).

        Returns:
            ``True`` if it was waiting in the queue (it is now skipped, named in the log);
            ``False`` if it is in flight (its copy reads it), or not queued at all.
        """
        path = path.rstrip("/")
        with self._cond:
            return self._queue.release(path)

    def dropped(self) -> list[str]:
        """Names deleted from the local tier by the disk budget before they were replicated."""
        with self._cond:
            return list(self._queue.dropped)

    def left(self) -> list[str]:
        """Names of the checkpoints not replicated (in flight, queued, or failed with an error
        that was reported), oldest first."""
        with self._cond:
            return self._queue.left()

    def replicated(self) -> set[str]:
        """Names this replicator committed (or found committed) on the remote tier."""
        with self._cond:
            return set(self._queue.done)

    def wait(self, deadline: float | None = None) -> bool:
        """Wait until nothing is queued or in flight, or ``deadline`` seconds have passed.

        Returns:
            ``True`` if everything submitted reached the remote tier (or was skipped by the
            queue policy), ``False`` otherwise (a hard error stopped it, one failed, or time
            ran out).
        """
        with self._cond:
            if not drain(
                lambda: self._idle() or self.failure is not None,
                Deadline(deadline),
                self._cond.wait,
            ):
                return False
            return self._idle() and self.failure is None and not self._queue.failed

    def _idle(self) -> bool:
        """Nothing queued or in flight, and the first scan done (the lock held)."""
        queue = self._queue
        busy = bool(queue.pending) or queue.in_flight is not None
        return not busy and (self._scanned or self._thread is None)

    def close(self, deadline: float | None) -> list[str]:
        """Drain the queue for up to ``deadline`` seconds, then stop the thread.

        The summary (one warning) names every checkpoint this run did not replicate: those
        still committed on the local tier, with the command that copies them, and those the
        queue skipped that have since left the local tier (retention or the disk budget
        deleted them), each with its reason.

        Returns:
            The names left behind on the local tier (``accelkit ckpt sync`` copies them),
            oldest first; a skipped checkpoint still committed locally is among them.
        """
        self.wait(deadline)
        with self._cond:
            self._closing = True
            left = self._queue.left()
            skipped = list(self._queue.skipped.values())
            done = set(self._queue.done)
            self._stop.set()
            self._cond.notify_all()
        reasons: dict[str, str] = {}
        gone: dict[str, str] = {}
        for job, why in skipped:
            if job.name in left or job.name in done:
                continue
            if self._still_local(job):  # the disk budget's deletion may have failed
                reasons[job.name] = why
                left.append(job.name)
            else:
                gone[job.name] = why
        left = sort_names(left)
        if left or gone:
            self._summary(left, reasons, gone)
        if self._thread is not None:
            self._thread.join(timeout=2)  # a daemon: one stuck in a network call is left
        return left

    def _still_local(self, job: _Job) -> bool:
        """Whether ``job``'s checkpoint is still committed on the local tier."""
        try:
            return self.local.exists(join(job.path, MANIFEST_NAME))
        except Exception:  # the summary says "not replicated" either way
            return True

    def sync_command(self) -> str:
        """The command that copies what this replicator left behind."""
        project = self.local_root.rsplit("/", 1)[0]
        return f"accelkit ckpt sync {project} {self.remote_project}"

    def _summary(self, left: list[str], reasons: dict[str, str], gone: dict[str, str]) -> None:
        parts = [f"Replication to {self.remote_root} stopped"]
        if left:
            named = ", ".join(
                name + (f" (skipped: {reasons[name]})" if name in reasons else "") for name in left
            )
            parts.append(
                f" with {len(left)} checkpoint(s) not replicated: {named}. They are committed "
                f"locally under {self.local_root}; copy them with `{self.sync_command()}`."
            )
        else:
            parts.append(".")
        if gone:
            named = ", ".join(f"{name} (skipped: {why})" for name, why in gone.items())
            parts.append(
                f" {len(gone)} checkpoint(s) never reached the remote tier and are no longer "
                f"on the local tier either: {named}."
            )
        logger.warning("".join(parts))

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._book.open()
            if not self._scanned:
                self._catch_up()
            while True:
                with self._cond:
                    self._scanned = True
                    self._cond.notify_all()
                    while True:
                        while not self._queue.pending and not self._closing:
                            self._cond.wait()
                        if self._closing or self.failure is not None:
                            return
                        job = max(self._queue.pending.values(), key=lambda j: j.iteration)
                        # Let the save that queued it return before the upload takes the CPU.
                        remaining = job.queued_at + START_GRACE_S - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    del self._queue.pending[job.name]
                    self._queue.in_flight = job
                outcome = self._replicate(job)
                with self._cond:
                    self._queue.in_flight = None
                    if outcome == "done":
                        self._queue.done.add(job.name)
                    elif outcome == "retry":  # interrupted: back into the queue
                        self._queue.pending.setdefault(job.name, job)
                    else:  # failed: left behind (named by close())
                        self._queue.failed[job.name] = job
                    self._cond.notify_all()
                if outcome in ("stop", "retry"):
                    return
        finally:
            with self._cond:
                self._scanned = True
                self._cond.notify_all()

    def _catch_up(self) -> None:
        try:
            local = committed_automatic(list_checkpoints(self.local, self.local_root))
            remote = self._list_remote()
        except Exception as exc:
            if self._failed(exc, "listing the checkpoints to catch up on"):
                return
            return
        there = {info.name: info.manifest for info in remote}
        for info in local:
            if info.manifest is None:
                continue
            twin = there.get(info.name)
            # By content: a remote folder of this name may hold another run's checkpoint; then
            # the copy refuses to overwrite it, and says so.
            if twin is None or not same_checkpoint(info.manifest, twin):
                self.submit(info.path, info.manifest)

    def _list_remote(self) -> list[CheckpointInfo]:
        infos = self._writer.list()
        with self._cond:
            self._queue.remote = infos
        return infos

    def _replicate(self, job: _Job) -> str:
        """Copy one checkpoint and apply the remote retention; ``"done"``, ``"skip"``
        (dropped after a non-transient error), ``"retry"`` (stopped mid-way) or ``"stop"``."""
        try:
            result, committed_at = self._writer.copy(job.name, job.path, job.manifest)
            self._list_remote()
        except Exception as exc:
            if self._stop.is_set() and classify(exc) == TRANSIENT:
                return "retry"
            return "stop" if self._failed(exc, f"replicating {job.name}") else "skip"
        lag = max(0.0, committed_at - job.manifest.created)
        with self._cond:
            queued = len(self._queue.pending)
        if self.on_replicated is not None:
            try:
                self.on_replicated(ReplicationReport(result, lag, queued))
            except Exception:
                logger.warning("After replicating %s:", job.name, exc_info=True)
        return "done"

    def _failed(self, exc: BaseException, doing: str) -> bool:
        """Report ``exc`` once; ``True`` if it stops replication (a hard error)."""
        if self._stop.is_set():  # shutting down: close() already named what is left
            logger.debug("Replication stopped while %s: %s", doing, exc)
            return True
        if classify(exc) == HARD:
            with self._cond:
                self.failure = exc
                self._cond.notify_all()
            logger.error(
                "Replication to %s stopped while %s: %s: %s. Fix: %s. Training goes on; "
                "the checkpoints stay on the local tier (copy them later with `accelkit ckpt "
                "sync`).",
                self.remote_project,
                doing,
                type(exc).__name__,
                exc,
                hard_error_fix(exc),
            )
            return True
        logger.error(
            "Replication to %s failed while %s: %s: %s. That checkpoint is not replicated; "
            "the next ones are.",
            self.remote_project,
            doing,
            type(exc).__name__,
            exc,
        )
        return False


def sort_names(names: Sequence[str]) -> list[str]:
    """``checkpoint_<n>`` names in numeric order."""
    return sorted(names, key=lambda n: (parse_checkpoint_name(n) or -1, n))
