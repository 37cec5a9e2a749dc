"""Forks of checkpoints: ``accelkit ckpt fork SRC DEST`` and ``accelkit ckpt ls --tree``.

``fork`` copies one committed checkpoint into a new project (``DEST/checkpoints/<its
name>``), with the code every replication runs (files verified against the manifest as they
are read, the manifest written last). The copy's manifest belongs to no tracker run and
records where it came from (``experiment.lineage``, ``"start": true``): the first job that
loads it, with a plain ``load_state()``, forks the source's runs, as
``load_state(SRC, fork=True)`` would, and every checkpoint it saves carries the lineage on.

``ls --tree`` lists the checkpoints of PATH (and of the projects named by ``--with``) by line
of descent: each fork is shown under the checkpoint it forked from.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from accelkit.checkpointing.catalog.lineage import Line, lineage_tree, parent_record, same_location
from accelkit.checkpointing.catalog.listing import COMMITTED, CheckpointInfo
from accelkit.cli._ckpt_common import (
    add_common,
    collect,
    command,
    nothing_found,
    open_storage,
    say,
    say_json,
    usage,
)
from accelkit.cli._table import format_runs

__all__ = ["register", "run_tree"]


def register(actions: Any) -> None:
    """Add the ``fork`` action to ``accelkit ckpt``'s sub-parsers."""
    parser = actions.add_parser(
        "fork",
        help="copy a checkpoint into a new project whose first load forks its tracker runs",
        description=__doc__.split("\n\n", 2)[1] if __doc__ else None,
    )
    add_common(parser, "SRC: the committed checkpoint to fork (a folder or URL)")
    parser.add_argument(
        "dest",
        metavar="DEST",
        help="the new project dir (local or URL): the copy goes to DEST/checkpoints/<name>",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=command("fork", _run_fork))


def _run_fork(args: argparse.Namespace) -> int:
    from accelkit.checkpointing.formats.layout import checkpoint_name, checkpoints_dir
    from accelkit.checkpointing.formats.manifest import Manifest, lineage_of
    from accelkit.checkpointing.replication import replicate_checkpoint
    from accelkit.checkpointing.replication.replicator import remote_options
    from accelkit.checkpointing.storage import get_storage, join
    from accelkit.delivery.retry import RetryPolicy
    from accelkit.trackers.delivery.runs import new_run_key

    storage = open_storage(args)
    _, infos, single = collect(storage, args.path)
    source = infos[0] if single and infos else None
    if not single or source is None:
        raise usage(
            f"{args.path!r} is a folder of checkpoints, not one committed checkpoint: give one "
            f"checkpoint folder, e.g. {args.path.rstrip('/')}/checkpoint_<n> (`accelkit ckpt "
            "ls` lists them)."
        )
    if source.state != COMMITTED or source.manifest is None:
        raise usage(
            f"{args.path!r} is {source.state}, not one committed checkpoint: fork a committed "
            f"one (`accelkit ckpt ls {args.path.rstrip('/').rsplit('/', 1)[0] or '.'}` shows "
            "their states)."
        )
    if source.manifest.process_index is not None:
        raise usage(
            f"{args.path!r} is one process's own checkpoint folder; fork the checkpoint that "
            "holds it (its parent folder)."
        )
    if not source.is_automatic and source.iteration is None:
        raise usage(
            f"{args.path!r} has no iteration, so no checkpoint_<n> name its project would "
            "resume from: fork it from the job instead, with load_state(path, fork=True)."
        )
    dest = args.dest.rstrip("/") or args.dest
    target_storage = get_storage(dest, remote_options(dest, dict(args.storage_options)))
    folder = checkpoints_dir(dest)
    # A checkpoint_<n> name, which load_state() without a path finds.
    name = source.name if source.is_automatic else checkpoint_name(int(source.iteration or 0))
    target = join(folder, name)
    newer = [
        i.name
        for i in _listed(target_storage, folder)
        if i.state == COMMITTED and (i.iteration or 0) >= (source.iteration or 0)
    ]
    if newer:
        raise usage(
            f"{dest!r} already holds {', '.join(newer[:5])}: the fork {name} would not "
            "be the checkpoint its project resumes from. Fork into a new project dir."
        )
    parent = parent_record(source.path, source.manifest)
    line = new_run_key()

    def rewrite(manifest: Manifest) -> Manifest:
        if lineage_of(manifest) and manifest.experiment["lineage"].get("start"):
            parent.update(lineage_of(manifest)["parent"])  # a fork of a fork's first copy
        lineage = {"id": line, "start": True, "parent": parent}
        return dataclasses.replace(manifest, experiment={"lineage": lineage})

    copied = replicate_checkpoint(
        storage, source.path, target_storage, target, RetryPolicy(deadline=60.0), rewrite=rewrite
    )
    if args.json:
        say_json({"source": source.path, "target": target, "line": line, "bytes": copied.bytes})
    else:
        say(
            f"forked  {source.path} -> {target} ({copied.bytes} bytes, line {line[:8]}): the "
            f"first job of {dest} that loads it opens new tracker runs forked from the source's"
        )
    return 0


def _listed(storage: Any, folder: str) -> list[CheckpointInfo]:
    from accelkit.checkpointing.catalog.listing import list_checkpoints

    return list_checkpoints(storage, folder) if storage.isdir(folder) else []


def run_tree(args: argparse.Namespace, infos: list[CheckpointInfo]) -> int:
    """``ckpt ls --tree``: ``infos`` and those of ``--with`` folders, by line of descent."""
    storage = open_storage(args)
    for other in args.with_ or []:
        _, found, _ = collect(storage, other)
        if not found:
            raise nothing_found(other, other)
        infos = infos + found
    roots = lineage_tree(infos)
    if args.json:
        say_json([_line_json(line) for line in roots])
        return 0
    say(*_render(roots, ""))
    return 0


def _line_json(line: Line) -> dict[str, Any]:
    return {
        "line": line.id,
        "parent": line.parent,
        "checkpoints": [
            {
                "name": i.name,
                "path": i.path,
                "state": i.state,
                "iteration": i.iteration,
                "step": i.step,
                "forks": [_line_json(f) for f in _forks_of(line, i)],
            }
            for i in line.checkpoints
        ],
    }


def _forks_of(line: Line, info: CheckpointInfo) -> list[Line]:
    return next((f for path, f in line.forks.items() if same_location(path, info.path)), [])


def _render(lines: list[Line], indent: str) -> list[str]:
    """The tree as text: a fork's header (``└─ fork <line> of <checkpoint>``) under the
    checkpoint it forked from, its checkpoints indented below it."""
    out = []
    for line in lines:
        inner = indent
        if line.parent is not None:
            parent = line.parent
            runs = format_runs({"runs": parent.get("runs", {})})
            out.append(
                f"{indent}└─ fork {str(line.id)[:8]} of {parent['checkpoint']} (after step "
                f"{parent.get('step', -1)}; parent runs {runs})"
            )
            inner = indent + "   "
        folder = None
        for info in line.checkpoints:
            where = info.path.rsplit("/", 1)[0]
            shown = f"  in {where}" if where != folder else ""
            folder = where
            out.append(
                f"{inner}{info.name}  {info.state}  iteration {_opt(info.iteration)}  step "
                f"{_opt(info.step)}  runs "
                f"{format_runs(None if info.manifest is None else info.manifest.experiment)}"
                f"{shown}"
            )
            out.extend(_render(_forks_of(line, info), inner + "   "))
    return out


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
