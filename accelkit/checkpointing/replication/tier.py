"""The remote tier composed with a run's checkpoint manager (issue #26, #38).

The manager knows one tier, ``project_dir`` (the local one), and calls the tiers composed with
it at three points (:class:`~accelkit.checkpointing.manager.Tier`): as a save starts (for what
runs after its commit), at retention (what to hold back, and the budget for it) and at
``load_state()`` without a folder (the resolve). :class:`RemoteTier` answers them for
``ReplicationOptions.to``: it owns the background
:class:`~accelkit.checkpointing.replication.replicator.Replicator` (and through it the tier
record, ``.accelkit-replication.json``), queues each committed automatic checkpoint, holds back
what is not replicated yet within ``local_budget_bytes``, resumes from the remote tier when it
holds a newer checkpoint than the local one, and drains the queue at the end of the run
(``end_training()``, interpreter exit) within ``deadline_seconds``.
:class:`~accelkit.checkpointing.tiered.TieredCheckpointManager` composes it with the manager.

Public API: :class:`RemoteTier`, :class:`TierSettings`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from accelkit.checkpointing.catalog.listing import (
    CheckpointInfo,
    committed_automatic,
    latest_checkpoint,
    list_checkpoints,
    next_iteration,
)
from accelkit.checkpointing.commit.deletion import HoldBudget
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.layout import checkpoints_dir
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.objects.contents import TrainingObjects
from accelkit.checkpointing.replication.options import ReplicationOptions
from accelkit.checkpointing.replication.replicator import (
    ReplicationReport,
    Replicator,
    remote_options,
)
from accelkit.checkpointing.restore.sequence import LoadResult, LoadSequence
from accelkit.checkpointing.storage import Storage, get_storage
from accelkit.delivery.exit import REPLICATION, ExitHook, at_exit

__all__ = ["RemoteTier", "TierSettings"]

logger = logging.getLogger(__name__)


class TierSettings(Protocol):
    """What the remote tier reads of the run's configuration (a
    :class:`~accelkit.checkpointing.ProjectConfiguration` is one), at each use: a setting
    changed since is followed."""

    @property
    def project_dir(self) -> str | None: ...

    @property
    def storage_options(self) -> Mapping[str, Any]: ...

    @property
    def replication(self) -> ReplicationOptions: ...


class RemoteTier:
    """The remote tier of a run (``ReplicationOptions.to``); inert without one.

    Args:
        settings: the run's configuration.
        is_main: whether this is the main process (the only one that replicates).
        storage_for: the storage of a location, with the run's options and retries (the
            manager's ``storage``).
        replicated: asked when the replicator starts: what to call (in its thread) after each
            checkpoint reached the remote tier, or ``None``.
        dropped: called after the local budget deleted a checkpoint not replicated yet.

    Attributes:
        replicator: the background replicator, once started (main process, with a remote
            tier); a save or :meth:`wait` starts it.
        drain_deadline: asked at the end of the run for how long to drain the queue (see
            :meth:`close`); ``None``: ``ReplicationOptions.deadline_seconds``.
    """

    def __init__(
        self,
        settings: TierSettings,
        is_main: bool,
        storage_for: Callable[[str], Storage],
        replicated: Callable[[], Callable[[ReplicationReport], None] | None],
        dropped: Callable[[CheckpointInfo], None],
    ) -> None:
        self.settings = settings
        self.is_main = is_main
        self.storage_for = storage_for
        self.replicated = replicated
        self.dropped = dropped
        self.replicator: Replicator | None = None
        self.drain_deadline: Callable[[], float | None] | None = None
        self._exit: ExitHook | None = None  # the replicator's drain at interpreter exit

    # ------------------------------------------------------------------ the manager's hooks

    def observer(self, automatic: bool) -> Callable[[str, Manifest], None] | None:
        """As a save starts: queue the checkpoint for the remote tier once committed (an
        automatic one, on the main process, with a remote tier); starts the replicator."""
        replicator = self.start() if automatic else None
        return None if replicator is None else replicator.submit

    def hold(self) -> tuple[Collection[str], HoldBudget | None]:
        """What local retention keeps back: the checkpoints not replicated yet, within
        ``local_budget_bytes``."""
        replicator = self.replicator
        if replicator is None:
            return (), None
        limit = self.settings.replication.local_budget_bytes
        budget = None if limit is None else HoldBudget(limit, replicator.release, self.dropped)
        return replicator.unreplicated(), budget

    def resolve(
        self, sequence: LoadSequence, objects: TrainingObjects, local: Callable[[], LoadResult]
    ) -> LoadResult:
        """``load_state()`` without a folder: the newest remote checkpoint if it is newer than
        every committed local one (a lost or new local disk), else ``local()``; then the run's
        counter moves past both tiers, so the next automatic save collides with neither."""
        to = self.settings.replication.to
        if not to or not self.settings.project_dir or sequence.root is None:
            return local()
        remote = self._remote_checkpoints(to)
        result = self._load_newer_remote(sequence, remote, objects)
        if result is None:
            result = local()
        if remote:
            sequence.counter.set(max(sequence.counter.value, next_iteration(remote)))
        return result

    # ------------------------------------------------------------------ the replicator

    def start(self) -> Replicator | None:
        """The replicator of this run (started at the first call), on the main process with a
        remote tier; ``None`` otherwise."""
        settings = self.settings
        to, project = settings.replication.to, settings.project_dir
        if not to or not self.is_main or not project:
            return None
        if self.replicator is None:
            self.replicator = Replicator(
                self.storage_for(project),
                project,
                get_storage(to, remote_options(to, settings.storage_options)),
                to,
                settings.replication.retention_policy(),
                queue_size=settings.replication.queue_size,
                on_replicated=self.replicated(),
            )
            self.replicator.start()
            self._exit = _close_at_exit(self)
        return self.replicator

    def wait(self, deadline: float | None = None) -> bool:
        """Wait up to ``deadline`` seconds (``None``: no limit) until every committed
        checkpoint of this run is on the remote tier (or was skipped by the queue policy).

        Returns:
            ``True`` without a remote tier, on processes other than the main one, or once the
            queue is drained; ``False`` if time ran out or a hard error stopped replication.
        """
        replicator = self.start()
        return True if replicator is None else replicator.wait(deadline)

    def close(self, deadline: float | None = None) -> list[str]:
        """Drain the queue for up to ``deadline`` seconds (default: :attr:`drain_deadline`'s
        answer, else ``deadline_seconds``) and stop the replicator; returns (and logs) the
        names of the checkpoints left behind. A later save starts a new replicator."""
        replicator, self.replicator = self.replicator, None
        if replicator is None:
            return []
        if self._exit is not None:
            self._exit.cancel()  # drained here: nothing left for the exit
            self._exit = None
        if deadline is None and self.drain_deadline is not None:
            deadline = self.drain_deadline()
        limit = self.settings.replication.deadline_seconds if deadline is None else deadline
        return replicator.close(limit)

    # ------------------------------------------------------------------ the remote resolve

    def _remote_checkpoints(self, to: str) -> list[CheckpointInfo]:
        """Every checkpoint on the remote tier (an empty list, with a warning, if it cannot be
        listed: the local tier is then all there is)."""
        root = checkpoints_dir(to)
        try:
            return list_checkpoints(self.storage_for(root), root)
        except Exception as exc:
            logger.warning(
                "Could not list the remote tier %s (%s: %s); load_state() considers the local "
                "tier only.",
                root,
                type(exc).__name__,
                exc,
            )
            return []

    def _load_newer_remote(
        self, sequence: LoadSequence, remote: list[CheckpointInfo], objects: TrainingObjects
    ) -> LoadResult | None:
        """Load the newest remote checkpoint newer than every committed local one; ``None``:
        the local tier has the newest (an intact local copy is preferred), or every newer
        remote one was refused.

        The remote tier is untrusted input like any checkpoint: one that fails the load's
        checks (a file that does not match its checksum, a manifest the listing did not catch)
        is skipped with a warning before anything is restored, and the next newest is tried,
        down to the local tier; a crafted remote checkpoint cannot make ``load_state()``
        fail while an intact one exists. (A folder's number is its name: a manifest that
        claims a higher iteration or step does not make it newer.)
        """
        root = sequence.root
        assert root is not None
        local = latest_checkpoint(self.storage_for(root), root)
        floor = -1 if local is None else (local.iteration or 0)
        newer = sorted(
            (i for i in committed_automatic(remote) if (i.iteration or 0) > floor),
            key=lambda info: info.iteration or 0,
            reverse=True,
        )
        for info in newer:
            logger.info(
                "Resuming from the remote tier: %s is newer than any committed local checkpoint.",
                info.path,
            )
            try:
                return dataclasses.replace(sequence.run(info.path, objects), tier="remote")
            except CorruptCheckpointError as exc:  # refused before anything was restored
                logger.warning(
                    "Skipping the remote checkpoint %s: %s. Trying the next newest checkpoint "
                    "on either tier.",
                    info.path,
                    exc,
                )
        return None


def _close_at_exit(tier: RemoteTier) -> ExitHook:
    """Drain ``tier``'s queue at interpreter exit (up to its deadline), without keeping it
    alive."""
    ref = weakref.ref(tier)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    # After the saves in flight commit (their checkpoints are queued here), before the trackers
    # drain (they report what was replicated): accelkit.delivery.exit's order.
    return at_exit(close, REPLICATION, "draining the replication queue")
