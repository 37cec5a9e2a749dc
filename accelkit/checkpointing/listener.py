"""What the checkpoint manager tells the rest of a run: the listener interface and its reports.

The manager knows nothing about experiment tracking; ``Accelerator`` connects the two by giving
the manager a :class:`CheckpointListener` (``accelkit._accelerator.experiment.ExperimentLink``). The
manager asks it, on the main process, what to record in a new checkpoint's manifest
(``experiment``), and tells it when a checkpoint was committed (on the main process, from the
thread that committed it), when one was loaded (on every process) and, with
``replicate_to``, when one reached the remote tier (optional ``checkpoint_replicated``, from the
replicator's thread) and when the local disk budget deleted one that had not (optional
``checkpoint_dropped``, from the thread that committed the save). Before a load that forks,
the manager calls the listener's optional ``check_fork()``, which raises to refuse it (nothing
is read then).

The manager calls a listener through :class:`SafeListener`, which logs a failing method (naming
it) and carries on: a tracker's trouble never fails a save or a load.

Public API: :class:`CheckpointListener`, :class:`SafeListener`, :class:`CommitReport`,
:class:`LoadReport`, :class:`DropReport`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.replication.replicator import ReplicationReport

__all__ = ["CheckpointListener", "CommitReport", "DropReport", "LoadReport", "SafeListener"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitReport:
    """One committed save.

    Attributes:
        path: the checkpoint's folder or URL.
        manifest: its manifest.
        seconds: from the ``save`` call to the commit.
        blocking_seconds: how long the ``save`` call blocked its caller (``seconds`` for a
            synchronous save).
        asynchronous: written in the background.
    """

    path: str
    manifest: Manifest
    seconds: float
    blocking_seconds: float
    asynchronous: bool


@dataclass(frozen=True)
class LoadReport:
    """One restored checkpoint.

    Attributes:
        path: the checkpoint's folder or URL.
        manifest: its manifest (Accelerate folders get one made up by the reader).
        seconds: from the ``load`` call to the restored state.
        fork: the caller asked to fork the checkpoint's runs (new runs that descend from it)
            instead of continuing them.
        tier: where it came from (:attr:`LoadResult.tier
            <accelkit.checkpointing.restore.sequence.LoadResult.tier>`).
    """

    path: str
    manifest: Manifest
    seconds: float
    fork: bool = False
    tier: str = "path"


@dataclass(frozen=True)
class DropReport:
    """A local checkpoint deleted before it reached the remote tier, because the checkpoints
    held back for replication exceeded ``replicate_local_budget_bytes``.

    Attributes:
        path: the deleted checkpoint's folder.
        manifest: its manifest.
        size_bytes: the bytes it freed.
    """

    path: str
    manifest: Manifest
    size_bytes: int


@runtime_checkable
class CheckpointListener(Protocol):
    """Told about every save and load of a :class:`~accelkit.checkpointing.manager.
    CheckpointManager`. Its methods must be quick (they run inside ``save``/``load``) and
    must not raise (failures are logged and ignored)."""

    def checkpoint_record(self) -> Mapping[str, Any]:
        """On the main process, before a save: JSON values for the manifest's ``experiment``."""
        ...

    def checkpoint_committed(self, report: CommitReport) -> None:
        """On the main process, after a commit (and its retention)."""
        ...

    def checkpoint_loaded(self, report: LoadReport) -> None:
        """On every process, after a load restored the state."""
        ...


class SafeListener:
    """A :class:`CheckpointListener` that calls another one and logs its failures instead of
    raising them (with the method's name and the traceback): what the manager calls.

    Args:
        listener: the listener to call.
    """

    def __init__(self, listener: CheckpointListener) -> None:
        self.listener = listener

    def checkpoint_record(self) -> Mapping[str, Any]:
        """The listener's record; ``{}`` (nothing recorded) if it fails."""
        try:
            return self.listener.checkpoint_record()
        except Exception:
            logger.warning("Checkpoint listener checkpoint_record failed:", exc_info=True)
            return {}

    def checkpoint_committed(self, report: CommitReport) -> None:
        """Tell the listener about a commit."""
        try:
            self.listener.checkpoint_committed(report)
        except Exception:
            logger.warning("Checkpoint listener checkpoint_committed failed:", exc_info=True)

    def checkpoint_loaded(self, report: LoadReport) -> None:
        """Tell the listener about a load."""
        try:
            self.listener.checkpoint_loaded(report)
        except Exception:
            logger.warning("Checkpoint listener checkpoint_loaded failed:", exc_info=True)

    def checkpoint_replicated(self, report: ReplicationReport) -> None:
        """Tell the listener that a checkpoint reached the remote tier (from the replicator's
        thread), if it has the optional method ``checkpoint_replicated(report)``."""
        self._optional("checkpoint_replicated", report)

    def checkpoint_dropped(self, report: DropReport) -> None:
        """Tell the listener that the disk budget deleted a checkpoint not yet replicated, if
        it has the optional method ``checkpoint_dropped(report)``."""
        self._optional("checkpoint_dropped", report)

    def _optional(self, name: str, report: Any) -> None:
        method = getattr(self.listener, name, None)
        if method is None:
            return
        try:
            method(report)
        except Exception:
            logger.warning("Checkpoint listener %s failed:", name, exc_info=True)
