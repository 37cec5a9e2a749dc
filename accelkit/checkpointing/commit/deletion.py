"""Deleting checkpoints: un-commit, then remove. The one place that deletes a checkpoint folder.

Training's retention (after each automatic commit, on the main process) and ``accelkit ckpt
prune`` both delete through :func:`delete_checkpoint`:

1. only a folder directly inside the checkpoints folder being cleaned, never a path outside it;
2. a committed checkpoint loses its manifest first, and the save marker ``.accelkit-save.json``
   goes last (:func:`remove_folder`), so an interrupted delete leaves an incomplete folder
   (ignored by loading, removed by the next prune), never a corrupt one nor one that looks
   foreign (which nothing would ever delete);
3. a folder planned as incomplete that holds a manifest by now (a save committed it meanwhile)
   is skipped.

Both run under the project's save lock (:mod:`~accelkit.checkpointing.commit.lock`): retention
inside the save that holds it, a prune by taking it with :func:`pruning_lock` (a prune that meets
a live save's lock is refused; a save that meets a prune's lock waits for it).

Public API: :func:`delete_checkpoint`, :func:`remove_folder`, :func:`apply_retention`,
:class:`HoldBudget`, :func:`project_of`, :func:`pruning_lock`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from accelkit.checkpointing.catalog.listing import (
    COMMITTED,
    INCOMPLETE,
    CheckpointInfo,
    list_checkpoints,
)
from accelkit.checkpointing.catalog.retention import RetentionPolicy, plan_retention
from accelkit.checkpointing.commit.lock import PRUNE, RunLock
from accelkit.checkpointing.errors import CheckpointPathError
from accelkit.checkpointing.formats.layout import (
    CHECKPOINTS_DIRNAME,
    MANIFEST_NAME,
    SAVE_MARKER_NAME,
)
from accelkit.checkpointing.storage import Storage, join

__all__ = [
    "HoldBudget",
    "apply_retention",
    "delete_checkpoint",
    "project_of",
    "pruning_lock",
    "remove_folder",
]

logger = logging.getLogger(__name__)


def _check_inside(root: str, info: CheckpointInfo) -> None:
    # Defence in depth: only direct children of the folder being cleaned are ever deleted.
    if "/" in info.name or info.name in ("", ".", "..") or info.path != join(root, info.name):
        raise CheckpointPathError(
            f"refusing to delete {info.path!r}: it is not directly inside {root!r}."
        )


def delete_checkpoint(storage: Storage, root: str, info: CheckpointInfo) -> bool:
    """Delete the committed or incomplete checkpoint ``info`` directly inside ``root``.

    Args:
        storage: the storage of ``root``.
        root: the checkpoints folder being cleaned.
        info: from :func:`~accelkit.checkpointing.catalog.listing.list_checkpoints` of ``root``.

    Returns:
        ``False`` if it was skipped: planned as incomplete, it has been committed meanwhile.

    Raises:
        CheckpointError: ``info`` is not directly inside ``root``, or is neither committed nor
            incomplete (accelkit deletes only what it can prove it wrote).
        OSError: the storage could not remove it (the folder is then incomplete at worst).
    """
    _check_inside(root, info)
    if info.state not in (COMMITTED, INCOMPLETE):
        raise CheckpointPathError(
            f"refusing to delete {info.path!r}: it is {info.state}, and accelkit deletes only "
            "committed or incomplete checkpoints it wrote."
        )
    manifest = join(info.path, MANIFEST_NAME)
    if info.state == INCOMPLETE and storage.exists(manifest):
        return False
    if info.state == COMMITTED:
        marker = join(info.path, SAVE_MARKER_NAME)
        if not storage.exists(marker):  # so that an interrupted delete is still provably ours
            storage.write_bytes(marker, b'{"format": "accelkit-save", "deleting": true}')
        storage.remove(manifest)  # un-commit first
    remove_folder(storage, info.path)
    return True


def remove_folder(storage: Storage, path: str) -> None:
    """Remove an uncommitted checkpoint folder, its save marker last: interrupted at any
    moment, it leaves a folder that is still provably accelkit's (incomplete, removed by the
    next prune), never one that looks foreign and is kept forever."""
    for rel in sorted(storage.walk_files(path)):
        if rel != SAVE_MARKER_NAME:
            storage.remove(join(path, rel))
    storage.rmtree(path)


@dataclass(frozen=True)
class HoldBudget:
    """The disk budget of the checkpoints that local retention holds back for replication.

    Local retention keeps a checkpoint it would delete while it is not yet on the remote tier
    (``protect`` of :func:`apply_retention`). With a remote tier that stays down, those pile
    up; this caps them: when their total size exceeds ``max_bytes``, the oldest of them are
    deleted anyway, oldest first, until the rest fits (each deletion said once, as a warning
    and through ``forced``). Never the checkpoint just committed, never one whose copy is in
    flight.

    Attributes:
        max_bytes: the most bytes of held-back checkpoints kept on the local tier (``0``:
            none; a checkpoint retention would delete is deleted even if not replicated).
        release: called with a held-back checkpoint's path before it is deleted; ``True`` if
            it may go (the replicator dropped it from its queue), ``False`` to keep it (its
            copy is in flight, or it was replicated meanwhile and goes at the next save).
        forced: called after each such deletion (a tracker event); its failures are logged.
        setting: the setting's name, for the warning.
    """

    max_bytes: int
    release: Callable[[str], bool]
    forced: Callable[[CheckpointInfo], None] | None = None
    setting: str = "replicate_local_budget_bytes"


def apply_retention(
    storage: Storage,
    root: str,
    policy: RetentionPolicy,
    keep: str,
    protect: Collection[str] = (),
    budget: HoldBudget | None = None,
    now: float | None = None,
) -> None:
    """Delete the committed ``checkpoint_<n>`` under ``root`` that ``policy`` does not keep
    (or that its byte budget, ``max_total_bytes``, removes), never ``keep`` (the checkpoint
    just committed), as :func:`~accelkit.checkpointing.catalog.retention.plan_retention` plans
    it at time ``now`` (for ``keep_recent_seconds``; the caller's clock). Failures are logged,
    not raised: the new checkpoint is committed whatever happens here. Paths in ``protect``
    (local checkpoints not yet replicated to the remote tier) are kept for now, with an info
    line, unless ``budget`` (a :class:`HoldBudget`) forces the oldest of them out.

    The promise of ``accelkit ckpt prune`` holds here too: the project is never left without a
    checkpoint that verifies, and a damaged one is never counted. It is kept without reading
    any checkpoint's bytes, because this runs after every save (reading every kept checkpoint
    each time would cost as much as the saves). What is known without reading:

    - ``keep`` verifies: its checksums were computed from the bytes this save wrote (or read
      back) moments ago, and it is never deleted;
    - the others are the listing's ``committed`` ones: manifest valid, every file present with
      its recorded size and no symbolic link inside (one stat per file, already paid by the
      listing). A missing, cut or grown file, a bad manifest or a link makes a checkpoint
      ``corrupt``, and corrupt ones are neither counted nor deleted.

    Bytes changed in place (a flipped bit, a re-signed manifest cannot be told from an honest
    one without reading) are the one damage this does not see: such a checkpoint may count
    toward ``total_limit`` and push an older one out, but ``keep`` stays, so a project always
    holds a checkpoint that verifies, and ``load_state()`` skips the damaged one. Modification
    times were considered and rejected as a signal: a copied project (``cp -r``, a sync tool)
    has new ones in any order, and would keep its checkpoints forever.
    """
    if policy.is_unlimited:
        return
    kept = keep.rstrip("/")
    try:
        listed = list_checkpoints(storage, root)
        # The listing already checked sizes; and keep is verified by construction.
        spare = [info.name for info in listed if info.path.rstrip("/") == kept]
        plan = plan_retention(listed, policy, lambda info: None, now=now, spare=spare)
        held = {p.rstrip("/") for p in protect}
        waiting: list[CheckpointInfo] = []
        for info in plan.delete:
            if info.path.rstrip("/") == kept:
                continue
            if info.path.rstrip("/") in held:  # not yet on the remote tier
                waiting.append(info)
                continue
            delete_checkpoint(storage, root, info)
        if budget is not None:
            waiting = _over_budget(storage, root, waiting, budget)
        for info in waiting:
            logger.info(
                "Retention keeps %s for now: it is not replicated yet (a later save's "
                "retention deletes it once it is).",
                info.path,
            )
        if plan.over_by:
            logger.warning(
                "The checkpoints under %s exceed max_total_bytes by %d bytes, and nothing "
                "left may be deleted (the newest checkpoint, folders accelkit did not write or "
                "that the script named, corrupt or incomplete ones). Fix: raise "
                "max_total_bytes, or remove those folders by hand.",
                root,
                plan.over_by,
            )
    except Exception as exc:
        logger.warning(
            "Retention under %s failed after committing %s: %s. Old checkpoints may remain;"
            " remove them with `accelkit ckpt prune`.",
            root,
            keep,
            exc,
        )


def _over_budget(
    storage: Storage, root: str, waiting: list[CheckpointInfo], budget: HoldBudget
) -> list[CheckpointInfo]:
    """Delete the oldest held-back checkpoints until the rest fit ``budget``; the kept ones."""
    total = sum(info.size_bytes for info in waiting)
    kept: list[CheckpointInfo] = []
    for info in sorted(waiting, key=lambda i: (i.iteration or 0, i.created)):
        if total <= budget.max_bytes or not budget.release(info.path):
            kept.append(info)
            continue
        delete_checkpoint(storage, root, info)
        total -= info.size_bytes
        logger.warning(
            "Retention deleted %s (%d bytes) before it reached the remote tier: the local "
            "checkpoints held back for replication would exceed %s=%d bytes. It is not "
            "replicated; the newer ones are kept for the remote tier. Fix: bring the remote "
            "tier back, or raise %s.",
            info.path,
            info.size_bytes,
            budget.setting,
            budget.max_bytes,
            budget.setting,
        )
        if budget.forced is not None:
            try:
                budget.forced(info)
            except Exception:
                logger.warning("After deleting %s:", info.path, exc_info=True)
    return kept


def project_of(root: str) -> str:
    """The project folder whose save lock guards the checkpoints folder ``root``: its parent
    if ``root`` is named ``checkpoints``, else ``root`` itself (no run saves automatic
    checkpoints there, but two prunes still exclude each other)."""
    stripped = root.rstrip("/")
    parent, _, name = stripped.rpartition("/")
    if name == CHECKPOINTS_DIRNAME and parent and not parent.endswith(":/"):
        return parent
    return stripped or root


@contextlib.contextmanager
def pruning_lock(storage: Storage, root: str) -> Iterator[RunLock]:
    """Hold the save lock of the project of ``root`` while deleting under it.

    Raises:
        CheckpointError: a live run holds it (a save in flight): nothing may be deleted now.
    """
    lock = RunLock(storage, project_of(root), role=PRUNE)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
