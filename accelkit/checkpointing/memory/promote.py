"""Committing the memory tier's newest snapshot as a checkpoint of the project when the job ends
without having saved it: the snapshots live in the job's shared memory, which goes with the job.

A job that fails with no restart left (a worker killed every time, or a hang the watchdog
stopped: exit 75 for the scheduler to requeue) may have snapshots newer than the newest
checkpoint on disk. ``accelkit launch`` calls :func:`promote_snapshots` after its workers are
gone and before it removes the job's memory: for each project in it, the newest step every
process has a snapshot of (its own, or the copy its peer keeps) becomes the project's next
``checkpoint_<n>``, if it is newer than the project's newest committed checkpoint. The requeued
job's ``load_state()`` then resumes from it as it would have from memory, bit for bit.

The checkpoint is assembled from the files the snapshots already hold (no second capture of
the state): process 0's snapshot gives every file (its model, optimizer, data positions,
registered objects, its random states), each other process's gives what is its own (its
random states, its resume fingerprint: the files its snapshot has and process 0's has not).
Each file is copied verified against its snapshot's manifest, as a replication copies, under
the commit protocol (save marker first, manifest last); the manifest keeps the reason
``"memory"`` and the step of the run's last save, so the resumed run saves on the uninterrupted
run's steps. A damaged snapshot leaves its attempt uncommitted and the next older step is
tried. Retention is not applied here: the next save of the requeued job applies it.

Which project a folder of the job's memory belongs to is in its :data:`PROJECT_RECORD`,
written by process 0 when it starts taking snapshots. The project's storage is opened without
``storage_options`` (those may hold secrets, never written to the job's memory): an object
store needs its credentials in the launcher's environment.

Public API: :func:`promote_snapshots`, :func:`record_project`, :data:`PROJECT_RECORD`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from accelkit._text import clip
from accelkit.checkpointing.catalog.listing import COMMITTED, list_checkpoints, next_iteration
from accelkit.checkpointing.commit.deletion import remove_folder
from accelkit.checkpointing.commit.lock import RunLock, claim_folder
from accelkit.checkpointing.commit.protocol import save_marker
from accelkit.checkpointing.formats.layout import (
    SAVE_MARKER_NAME,
    checkpoint_name,
    checkpoints_dir,
)
from accelkit.checkpointing.formats.manifest import MEMORY_SNAPSHOT, Manifest, write_manifest
from accelkit.checkpointing.memory.peer import COPIES
from accelkit.checkpointing.memory.tier import SNAPSHOT_PREFIX
from accelkit.checkpointing.replication.copy import copy_file
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.checkpointing.storage.confined import confine

__all__ = ["PROJECT_RECORD", "promote_snapshots", "record_project"]

logger = logging.getLogger("accelkit.checkpointing.memory")

#: The file, in a project's folder of the job's memory, naming the project it belongs to.
PROJECT_RECORD = "project.json"
_MAX_RECORD = 1 << 16


def record_project(folder: str, project_dir: str, world_size: int) -> None:
    """Write ``<folder>/project.json``: the project (``project_dir``) and its process count, for
    :func:`promote_snapshots` (process 0, once, before its first snapshot); atomic."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, PROJECT_RECORD)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump({"project_dir": project_dir, "world_size": world_size}, file)
    os.replace(temporary, path)


@dataclass(frozen=True)
class _Snapshot:
    path: str
    manifest: Manifest


def promote_snapshots(memory_dir: str, say: Callable[[str], None] | None = None) -> list[str]:
    """Commit, for each project of the job's memory ``memory_dir``, its newest complete snapshot
    as the project's next checkpoint when it is newer than the project's newest one (see the
    module docstring). Never raises: what goes wrong is said (``say``, default: the logger)
    and the job's end goes on.

    Returns:
        The checkpoints committed.
    """
    tell = say if say is not None else logger.warning
    committed: list[str] = []
    try:
        names = sorted(os.listdir(memory_dir))
    except OSError:
        return committed
    for name in names:
        folder = os.path.join(memory_dir, name)
        if os.path.islink(folder) or not os.path.isdir(folder):
            continue
        try:
            path = _promote_project(folder, tell)
        except Exception as exc:  # the job's end must go on: say it, never raise
            problem = clip(str(exc), 500)
            tell(f"the memory snapshots in {folder} were not committed to disk ({problem})")
            continue
        if path is not None:
            committed.append(path)
    return committed


def _promote_project(folder: str, tell: Callable[[str], None]) -> str | None:
    record = _read_record(folder)
    if record is None:
        return None
    project_dir, world = record
    by_rank = [_snapshots(folder, rank, world) for rank in range(world)]
    common = set.intersection(*(set(steps) for steps in by_rank)) if by_rank else set()
    if not common:
        return None
    root = checkpoints_dir(project_dir)
    storage = get_storage(root)
    infos = list_checkpoints(storage, root) if storage.exists(root) else []
    on_disk = [i.step for i in infos if i.state == COMMITTED and i.step is not None]
    newest_disk = max(on_disk) if on_disk else None
    lock = RunLock(get_storage(project_dir), project_dir)
    lock.acquire()
    try:
        for step in sorted(common, reverse=True):
            if newest_disk is not None and step <= newest_disk:
                return None
            snapshots = [steps[step] for steps in by_rank]
            iteration = next_iteration(list_checkpoints(storage, root))
            target = join(root, checkpoint_name(iteration))
            # Ours only once claimed: a folder that appeared meanwhile is never written into,
            # nor removed (the error goes up: nothing is committed).
            claim_folder(storage, target, SAVE_MARKER_NAME, save_marker(promoted_from="memory"))
            try:
                _commit(storage, target, iteration, snapshots)
            except Exception as exc:
                remove_folder(storage, target)
                tell(
                    f"the memory snapshot of step {step} was not committed to disk "
                    f"({clip(str(exc), 500)}); trying the next older one"
                )
                continue
            since = "any checkpoint" if newest_disk is None else f"step {newest_disk} on disk"
            tell(
                f"committed the memory snapshot of step {step} as {target} (newer than "
                f"{since}): the next load_state() resumes from it"
            )
            return target
    finally:
        lock.release()
    return None


def _read_record(folder: str) -> tuple[str, int] | None:
    """The project and process count of ``folder``'s record (untrusted: checked), else ``None``."""
    path = os.path.join(folder, PROJECT_RECORD)
    if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > _MAX_RECORD:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    project, world = record.get("project_dir"), record.get("world_size")
    if not isinstance(project, str) or not project or len(project) > 4096:
        return None
    if isinstance(world, bool) or not isinstance(world, int) or not 0 < world <= 1 << 20:
        return None
    return project, world


def _snapshots(folder: str, rank: int, world: int) -> dict[int, _Snapshot]:
    """Process ``rank``'s committed snapshots, by step: its own, else the copy its peer keeps."""
    found: dict[int, _Snapshot] = {}
    for where in (
        os.path.join(folder, COPIES, f"rank_{rank}"),
        os.path.join(folder, f"rank_{rank}"),
    ):
        if os.path.islink(where) or not os.path.isdir(where):
            continue
        storage = get_storage(where)
        for info in list_checkpoints(storage, where):
            manifest = info.manifest
            if (
                info.state == COMMITTED
                and manifest is not None
                and info.name == f"{SNAPSHOT_PREFIX}{manifest.step}"
                and manifest.reason == MEMORY_SNAPSHOT
                and manifest.process_index == (None if world == 1 else rank)
                and manifest.world_size == world
                and not os.path.islink(info.path)
            ):
                found[manifest.step] = _Snapshot(info.path, manifest)  # its own wins (last)
    return found


def _commit(storage: Storage, target: str, iteration: int, snapshots: list[_Snapshot]) -> None:
    """Fill the claimed folder ``target`` (checkpoint ``iteration``) from ``snapshots`` (one per
    process, process 0 first), each file verified as it is copied, and commit it."""
    first = snapshots[0].manifest
    sources = {entry.path: (snapshots[0], entry) for entry in first.files}
    for snapshot in snapshots[1:]:
        for entry in snapshot.manifest.files:
            sources.setdefault(entry.path, (snapshot, entry))  # what is its own
    for path, (snapshot, entry) in sorted(sources.items(), key=lambda item: -item[1][1].size):
        source = confine(get_storage(snapshot.path), snapshot.path)  # no link followed out
        copy_file(source, join(snapshot.path, path), entry, storage, join(target, path))
    manifest = replace(
        first,
        iteration=iteration,
        files=[entry for _, entry in sorted(sources.values(), key=lambda item: item[1].path)],
        created=time.time(),
        process_index=None,
    )
    write_manifest(storage, target, manifest)
