"""Which checkpoints descend from which: the lines of descent that forks start.

A job that forks a checkpoint (``Accelerator.load_state(path, fork=True)``, or a copy made by
``accelkit ckpt fork``) starts a *line*: every checkpoint it saves, and every checkpoint of a
job resumed from those, records the line's id and its parent checkpoint in its manifest
(``experiment.lineage``, see :class:`~accelkit.checkpointing.formats.manifest.Manifest`).
Checkpoints with no lineage belong to the root line of their folder.

:func:`lineage_tree` groups listed checkpoints (of one project or several) into lines and
hangs each line under the checkpoint it forked, when that checkpoint is listed too; a line
whose parent is not listed is a root of its own, and says where it came from. Nothing here
reads a file: the manifests were read (and their lineage checked) by the listing.

Public API: :class:`Line`, :func:`lineage_tree`, :func:`same_location`, :func:`parent_record`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from accelkit.checkpointing.catalog.listing import CheckpointInfo
from accelkit.checkpointing.formats.manifest import Manifest, lineage_of

__all__ = ["Line", "lineage_tree", "parent_record", "same_location"]


@dataclass
class Line:
    """Checkpoints of one line of descent, oldest first.

    Attributes:
        id: the line's id (``None``: the checkpoints of a folder that descend from no fork).
        parent: where the line forked from (``experiment.lineage.parent``: ``checkpoint``,
            ``iteration``, ``step``, ``key``, ``runs``), ``None`` for a root line.
        checkpoints: its checkpoints, in the order listed.
        forks: checkpoint path -> the lines forked from it (those listed).
    """

    id: str | None
    parent: dict[str, Any] | None
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    forks: dict[str, list[Line]] = field(default_factory=dict)


def parent_record(path: str, manifest: Manifest) -> dict[str, Any]:
    """``experiment.lineage.parent`` for a fork of the checkpoint at ``path``: where it is (a
    local path made absolute, so another folder's listing finds it), its iteration, its last
    logged step (the forked runs log after it), its run key, its own line and its runs."""
    record = manifest.experiment
    parent: dict[str, Any] = {
        "checkpoint": path if "://" in path else os.path.abspath(path),
        "iteration": manifest.iteration,
        "step": int(record.get("step", -1)),
    }
    if record.get("key") is not None:
        parent["key"] = record["key"]
    line = lineage_of(manifest).get("id")
    if line is not None:
        parent["id"] = line
    parent["runs"] = dict(record.get("runs", {}))
    return parent


def same_location(a: str, b: str) -> bool:
    """Whether two checkpoint locations name the same folder (local paths made absolute and
    normalised, URLs compared without a trailing ``/``)."""
    return _location(a) == _location(b)


def _location(path: str) -> str:
    if "://" in path:
        return path.rstrip("/")
    return os.path.normpath(os.path.abspath(path))


def lineage_tree(infos: Iterable[CheckpointInfo]) -> list[Line]:
    """The root lines of ``infos`` (any folders, in the order given), forks hung under the
    checkpoints they forked (see the module docstring)."""
    lines: dict[tuple[str, str | None], Line] = {}
    for info in infos:
        lineage = {} if info.manifest is None else lineage_of(info.manifest)
        parent = lineage.get("parent")
        line_id = lineage.get("id")
        # A line without an id (or the unforked checkpoints) is one per folder.
        folder = _location(info.path).rsplit("/", 1)[0] if line_id is None else ""
        line = lines.setdefault((folder, line_id), Line(line_id, parent))
        line.checkpoints.append(info)
    where = {_location(i.path): line for line in lines.values() for i in line.checkpoints}
    holders: dict[int, Line] = {}  # id(line) -> the line holding its parent checkpoint
    for line in lines.values():
        holder = None if line.parent is None else where.get(_location(line.parent["checkpoint"]))
        if holder is not None and not _descends(holder, line, holders):
            holders[id(line)] = holder  # (a crafted circle of parents is cut: a root)
    roots = []
    for line in lines.values():
        holder = holders.get(id(line))
        if holder is None or line.parent is None:
            roots.append(line)
        else:
            holder.forks.setdefault(_location(line.parent["checkpoint"]), []).append(line)
    return roots


def _descends(line: Line, ancestor: Line, holders: dict[int, Line]) -> bool:
    """Whether ``line`` is ``ancestor`` or descends from it through ``holders``."""
    seen: set[int] = set()
    current: Line | None = line
    while current is not None and id(current) not in seen:
        if current is ancestor:
            return True
        seen.add(id(current))
        current = holders.get(id(current))
    return False
