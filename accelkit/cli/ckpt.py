"""``accelkit ckpt``: list, prune, verify and inspect checkpoints on a local disk or any fsspec URL.

Everything here goes through :mod:`accelkit.checkpointing` (listing and states from
``catalog``, checks from ``manifest.verify_files``, the retention policy training uses, safetensors
headers from ``checkpointing.inspect``); this module only parses arguments and prints, through
``say``/``say_json``/``render_table`` only: every name printed comes from an untrusted
checkpoint and is escaped there (see :mod:`accelkit.cli._ckpt_common`).

Exit codes: 0 success; 1 a check failed, nothing matched, or the user declined; 2 bad usage (a
bad flag, a path that does not exist or cannot be opened, a prune that needs confirmation).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import textwrap
import time
from collections.abc import Iterable
from typing import Any

from accelkit._text import at_most, clip
from accelkit.checkpointing.catalog.listing import (
    ACCELERATE,
    COMMITTED,
    CORRUPT,
    FOREIGN,
    INCOMPLETE,
    NOT_OURS,
    CheckpointInfo,
    committed_automatic,
    latest_checkpoint,
    list_checkpoints,
)
from accelkit.checkpointing.catalog.retention import (
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLast,
    KeepRecent,
    MaxTotalBytes,
    RetentionPlan,
    RetentionPolicy,
    build_policy,
    plan_retention,
)
from accelkit.checkpointing.commit.deletion import delete_checkpoint, project_of, pruning_lock
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.formats.layout import (
    CHECKPOINTS_DIRNAME,
    MANIFEST_NAME,
    checkpoints_dir,
    parse_checkpoint_name,
)
from accelkit.checkpointing.formats.manifest import malformed, resumed_of, verify_files
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.checkpointing.storage.confined import confine
from accelkit.cli import ckpt_diff, ckpt_export, ckpt_import, ckpt_lineage, ckpt_sync
from accelkit.cli._ckpt_common import (
    Fail,
    accelerate_note,
    add_common,
    collect,
    command,
    duration_type,
    nothing_found,
    open_storage,
    positive_int,
    print_help,
    progress,
    say,
    say_json,
    size_type,
    usage,
    with_accelerate_steps,
)
from accelkit.cli._table import format_age, format_runs, format_size, one_entry, render_table

__all__ = ["register"]

_EPILOG = """\
PATH is a local path or an fsspec URL (s3://bucket/run, memory://run, gcs://...). For S3, give
the endpoint and credentials with -o (e.g. -o endpoint_url=http://127.0.0.1:8333 -o key=K
-o secret=S) or the usual AWS_* environment variables.

Exit codes: 0 success; 1 a check failed or nothing matched; 2 bad usage (including a PATH that
does not exist).
"""


def _wrap(text: str) -> str:
    # Raw formatting keeps the epilog's layout; descriptions are filled here, one paragraph
    # per "\n\n".
    return "\n\n".join(textwrap.fill(p, 92) for p in text.split("\n\n"))


def register(subparsers: Any) -> None:
    """Add the ``ckpt`` subcommand (``ls``, ``prune``, ``verify``, ``inspect``, ``import``)."""
    fmt = argparse.RawDescriptionHelpFormatter
    ckpt = subparsers.add_parser(
        "ckpt",
        # `accelkit --help` is where users look for a command: every action is named here.
        help="checkpoints (local or fsspec URL): ls, prune, verify, inspect, import "
        "(from accelerate), sync (to a remote tier), diff, export (to Hugging Face files), "
        "fork (into a new project)",
        description="Manage the checkpoints of a run without writing Python.",
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    ckpt.set_defaults(func=functools.partial(print_help, ckpt))
    actions = ckpt.add_subparsers(dest="ckpt_action", metavar="ACTION")

    ls = actions.add_parser(
        "ls",
        help="list checkpoints with their state, size, age, tracker runs and metrics",
        description=_wrap(
            "List the checkpoints under PATH, newest last. State is 'committed' (its "
            "manifest accelkit.json is valid and every file has the recorded size), 'incomplete' "
            "(no manifest: a save in flight or one that crashed) or 'corrupt' (a bad manifest, or "
            "a file missing or of the wrong size; checksums are checked by `ckpt verify`). RUNS "
            "names the tracker runs the checkpoint belongs to (tracker:run id; --json gives "
            "each tracker's full reference under 'experiment'). REASON says why it was made: "
            "'user' (save_state), 'interval' (save_every_steps/seconds) or 'preemption' (a "
            "preemption signal). RESUMED says what the job that saved it had resumed from, as "
            "tier:folder: 'memory' (a memory snapshot of the job, memory_snapshot_every_steps), "
            "'local' (a checkpoint of the project), 'remote' (the remote tier of replicate_to) "
            "or 'path' (a folder the script named); shown when some job resumed. "
            "A project saved with replicate_to also shows TIER (local, "
            "remote or both) and LAG (from the local to the remote commit; 'waiting 5m' for a "
            "committed checkpoint not replicated yet), as its replicator recorded them in "
            ".accelkit-replication.json; --remote URL lists the remote tier itself. Exits 1 if "
            "PATH holds no checkpoint."
        ),
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    add_common(ls, "a checkpoints folder, a project dir (uses PATH/checkpoints) or one checkpoint")
    ls.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    ls.add_argument(
        "--remote",
        metavar="URL",
        help="the run's replicate_to (remote tier), listed to give the TIER column (local, "
        "remote, both); without it, a project that replicates shows the tiers its replicator "
        "recorded (its remote tier is never contacted unless named here)",
    )
    ls.add_argument(
        "--tree",
        action="store_true",
        help="by line of descent: each fork (load_state(fork=True), ckpt fork) under the "
        "checkpoint it forked from",
    )
    ls.add_argument(
        "--with",
        dest="with_",
        action="append",
        metavar="PATH",
        help="with --tree: another project's checkpoints, linked to PATH's (repeatable)",
    )
    ls.set_defaults(func=command("ls", _run_ls))

    prune = actions.add_parser(
        "prune",
        help="delete old checkpoints with training's retention policy, and stale incomplete ones",
        description=_wrap(
            "Delete the committed checkpoint_<n> checkpoints that the retention policy "
            "does not keep (the same code as ProjectConfiguration(total_limit=...) uses during "
            "training; rules combine, a checkpoint is kept if any rule keeps it), and incomplete "
            "folders older than the newest committed checkpoint (a newer one may be a save in "
            "flight and is kept). Corrupt checkpoints and folders that are not checkpoints are "
            "never deleted. Nothing outside PATH is touched. The checkpoints the policy would "
            "keep are first checked against their checksums (as `ckpt verify` does): a damaged "
            "one is kept but does not count toward --keep (an older intact one is kept in its "
            "place), and the newest checkpoint that verifies is never deleted.\n\n"
            "Rules by time use the commit time each manifest records: --keep-one-every 6h "
            "keeps the first checkpoint of every 6-hour window of the clock "
            "(ProjectConfiguration's keep_every_seconds), --keep-recent 2d every one committed "
            "in the last 2 days (keep_recent_seconds). --max-bytes 500GB is a budget for the "
            "whole folder (max_total_bytes): after the rules, the oldest checkpoints they keep "
            "are deleted until everything listed fits, never the newest that verifies and never "
            "a folder accelkit did not write, one the script named, a corrupt or damaged one; "
            "if only those are left, prune says by how much the budget is still exceeded.\n\n"
            "Confirmation: with --yes it deletes at once; without --yes it shows the plan and asks "
            "on a terminal, and when stdin is not a terminal (a script, CI) it deletes nothing and "
            "exits 2. --dry-run only shows the plan. Exits 0 when there is nothing to delete."
        ),
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    add_common(prune, "a checkpoints folder or a project dir (uses PATH/checkpoints)")
    prune.add_argument("--keep", type=positive_int, metavar="N", help="keep the newest N")
    prune.add_argument(
        "--keep-every",
        type=positive_int,
        metavar="K",
        help="also keep every checkpoint whose iteration is a multiple of K",
    )
    prune.add_argument(
        "--keep-best",
        type=positive_int,
        metavar="K",
        help="also keep the best K by --metric (a metric given to save_state)",
    )
    prune.add_argument("--metric", metavar="M", help="metric name for --keep-best")
    prune.add_argument(
        "--mode",
        choices=("min", "max"),
        default="min",
        help="for --keep-best: 'min' if lower is better (a loss; default), 'max' otherwise",
    )
    prune.add_argument(
        "--keep-one-every",
        type=duration_type("--keep-one-every"),
        metavar="DURATION",
        help="also keep the first checkpoint of every window of DURATION (seconds, or 90s, "
        "30m, 6h, 2d, 1w), by commit time",
    )
    prune.add_argument(
        "--keep-recent",
        type=duration_type("--keep-recent"),
        metavar="DURATION",
        help="also keep every checkpoint committed in the last DURATION (e.g. 2d)",
    )
    prune.add_argument(
        "--max-bytes",
        type=size_type("--max-bytes"),
        metavar="SIZE",
        help="byte budget for the whole folder (bytes, or 500MB, 5GB, 2GiB): the oldest "
        "checkpoints the rules keep go too until it fits",
    )
    prune.add_argument("--dry-run", action="store_true", help="show what would go; delete nothing")
    prune.add_argument("-y", "--yes", action="store_true", help="delete without asking")
    prune.set_defaults(func=command("prune", _run_prune))

    verify = actions.add_parser(
        "verify",
        help="check every file's size and checksum against the manifest",
        description=_wrap(
            "Check every file of a committed checkpoint (or of every checkpoint under "
            "a folder) against the sizes and checksums in its manifest. A folder written by "
            "Hugging Face accelerate's save_state records no checksums: every file of it is "
            "read to its end at its listed size, and the folder is read as load_state reads "
            "it (pickles through the allow-list). Exits 1, naming the files, if any is "
            "missing, unreadable or differs, if a manifest is unreadable, if PATH is one "
            "checkpoint without a manifest, or if there is no checkpoint to check. "
            "Incomplete folders inside a folder of checkpoints are reported and skipped."
        ),
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    add_common(verify, "one checkpoint, a checkpoints folder or a project dir")
    verify.add_argument(
        "--json", action="store_true", help="print the verdicts as JSON (same exit codes)"
    )
    verify.set_defaults(func=command("verify", _run_verify))

    inspect = actions.add_parser(
        "inspect",
        help="list tensors (name, dtype, shape, file) without loading them",
        description=_wrap(
            "List the tensors of a checkpoint, a save_model folder, a "
            "model.safetensors.index.json or one .safetensors file, read from the safetensors "
            "headers (no tensor data is loaded). A project dir or checkpoints folder stands "
            "for its newest committed checkpoint. Exits 1 if there is no safetensors file or a "
            "header is damaged."
        ),
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    add_common(inspect, "a checkpoint, a save_model folder, an index JSON or a .safetensors")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(func=command("inspect", _run_inspect))
    ckpt_import.register(actions)
    ckpt_export.register(actions)
    ckpt_sync.register(actions)
    ckpt_lineage.register(actions)
    ckpt_diff.register(actions)


# --------------------------------------------------------------------------- ls


def _as_json(info: CheckpointInfo) -> dict[str, Any]:
    manifest = info.manifest
    return {
        "name": info.name,
        "path": info.path,
        "state": info.state,
        "iteration": info.iteration,
        "step": info.step,
        "size_bytes": info.size_bytes,
        "files": info.files,
        "created": info.created if manifest is not None else None,
        "created_iso": (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.created))
            if manifest is not None
            else None
        ),
        "world_size": None if manifest is None else manifest.world_size,
        "reason": None if manifest is None else manifest.reason,
        "metrics": dict(info.metrics),
        "experiment": None if manifest is None else dict(manifest.experiment),
        "error": info.error,
    }


def _resumed_cell(info: CheckpointInfo) -> str:
    """``tier:folder`` of the checkpoint the saving job resumed from (``-``: none)."""
    resumed = {} if info.manifest is None else resumed_of(info.manifest)
    if not resumed:
        return "-"
    return f"{resumed['tier']}:{one_entry(resumed['checkpoint'][:60], ' ')}"


def _format_metrics(metrics: dict[str, float]) -> str:
    # One cell of a table: a crafted manifest's names may be megabytes long, number in the
    # hundreds of thousands, or hold " " and "=" to fake another metric's value ("acc=0.99 x").
    names = sorted(metrics)
    cells = [f"{one_entry(k[:40], '=')}={metrics[k]:.6g}" for k in names[:_MAX_METRICS]]
    if len(names) > _MAX_METRICS:
        cells.append(f"(+{len(names) - _MAX_METRICS} more: --json)")
    return " ".join(cells) or "-"


_MAX_METRICS = 8


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _run_ls(args: argparse.Namespace) -> int:
    storage = open_storage(args)
    root, infos, _ = collect(storage, args.path)
    infos, tiers, tier_notes = _tiers(args, storage, root, infos)
    if not infos:
        if args.json:
            say_json([])
        raise nothing_found(args.path, root)
    infos, unknown_steps = with_accelerate_steps(storage, infos)
    if args.with_ and not args.tree:
        raise usage("--with lists another project beside PATH's tree: add --tree.")
    if args.tree:
        return ckpt_lineage.run_tree(args, infos)
    if args.json:
        say_json([_as_json(i) | _tier_json(tiers, i) for i in infos])
        for line in [*tier_notes, *unknown_steps]:  # stderr: the JSON stays whole
            say(line, err=True)
        return 0
    now = time.time()
    resumes = any(i.manifest is not None and resumed_of(i.manifest) for i in infos)
    rows = [
        [
            i.name,
            i.state,
            _opt(i.iteration),
            _opt(i.step),
            format_size(i.size_bytes),
            str(i.files),
            format_age(now - i.created if i.manifest is not None else None),
            "-" if i.manifest is None else i.manifest.reason,
            format_runs(None if i.manifest is None else i.manifest.experiment),
            _format_metrics(i.metrics),
        ]
        + ([_resumed_cell(i)] if resumes else [])
        + ([tiers[i.name].tier, _lag_cell(tiers[i.name])] if tiers else [])
        for i in infos
    ]
    headers = [
        *("NAME", "STATE", "ITER", "STEP", "SIZE", "FILES", "AGE", "REASON", "RUNS", "METRICS")
    ]
    headers += ["RESUMED"] if resumes else []
    headers += ["TIER", "LAG"] if tiers else []
    print(render_table(headers, rows, right=("ITER", "STEP", "SIZE", "FILES", "AGE")))
    for info in infos:
        if info.state == CORRUPT:
            say(
                f"{info.name}: corrupt: {info.error}. Run `accelkit ckpt verify {info.path}`.",
                err=True,
            )
        elif info.state == FOREIGN:
            say(f"{info.name}: {info.error}.", err=True)
    note = accelerate_note(
        infos, "STEP is the optimizer steps read from their optimizer state (no code runs);"
    )
    for line in [*([note] if note else []), *tier_notes, *unknown_steps]:
        say(line, err=True)
    return 0


@dataclasses.dataclass(frozen=True)
class _Tier:
    tier: str  # local, remote or both
    source: str  # "listing" (--remote) or "record" (the project's record, unchecked)
    lag: float | None = None  # seconds from the local to the remote commit
    waiting: float | None = None  # seconds a committed local-only checkpoint has waited


def _tiers(
    args: argparse.Namespace, storage: Storage, root: str, infos: list[CheckpointInfo]
) -> tuple[list[CheckpointInfo], dict[str, _Tier], list[str]]:
    """Every checkpoint of either tier (the local entry where both have one), each one's tier
    (``local``, ``remote``, ``both``: committed on both) and replication lag, and the notes to
    print.

    The tiers come from the remote listing with ``--remote URL``; without it, from the
    project's record of its remote tier (``.accelkit-replication.json``, written by the
    replicator), as recorded. The recorded location is shown, never contacted: the project
    folder is untrusted input, and a crafted record must not make a listing reach a host the
    user did not name (an internal service behind ``http://...``, a bucket that logs who
    reads it). ``--remote`` is how the user names the remote tier to check.
    """
    from accelkit.checkpointing.formats.tier_record import (
        TierRecordError,
        public_location,
        read_record,
    )

    notes: list[str] = []
    record = None
    project = project_of(root) if root.rstrip("/").endswith("/" + CHECKPOINTS_DIRNAME) else None
    if project is not None:
        try:
            record = read_record(storage, project)
        except TierRecordError as exc:
            notes.append(f"tier record ignored: {exc}")
    if args.remote and record is not None and record.replicate_to != public_location(args.remote):
        notes.append(
            f"the project's record names another remote tier ({clip(record.replicate_to, 200)}"
            "); its replication lag is not shown."
        )
        record = None
    if not args.remote and record is None:
        return infos, {}, notes
    entries = {} if record is None else record.checkpoints
    local = {i.name: i for i in infos}
    merged = list(infos)
    if args.remote:
        remote_root = checkpoints_dir(args.remote)
        listing = list_checkpoints(
            get_storage(remote_root, dict(args.storage_options)), remote_root
        )
        from accelkit.checkpointing.replication.copy import same_checkpoint

        remote = {}
        others: list[str] = []
        for info in listing:
            twin = local.get(info.name)
            if twin is None:
                merged.append(info)
            # By content, not by name: the remote folder may hold another run's checkpoint.
            same = (
                twin is None
                or twin.manifest is None
                or (info.manifest is not None and same_checkpoint(twin.manifest, info.manifest))
            )
            remote[info.name] = info.state == COMMITTED and same
            if info.state == COMMITTED and not same:
                others.append(info.name)
        if others:
            notes.append(
                f"the remote tier holds other checkpoints under the names of local ones (their "
                f"files or iteration differ): {', '.join(at_most(others, 10))}. The local ones "
                "are not replicated, and `accelkit ckpt sync` refuses to overwrite the remote ones."
            )
        source = "listing"
    else:
        assert record is not None
        remote = dict.fromkeys(entries, True)
        remote_root = checkpoints_dir(record.replicate_to)
        for name, recorded in entries.items():
            if name not in local:
                merged.append(
                    CheckpointInfo(
                        name, join(remote_root, name), COMMITTED, parse_checkpoint_name(name),
                        None, recorded.committed, 0, 0, is_automatic=True,
                    )
                )  # fmt: skip
        source = "record"
        notes.append(
            f"TIER and LAG as recorded by the replicator {format_age(time.time() - record.updated)}"
            f" ago for the remote tier {clip(record.replicate_to, 200)} (not contacted: add "
            "--remote URL to check it)."
        )
    now = time.time()
    tiers: dict[str, _Tier] = {}
    for info in merged:
        on_local = info.name in local and local[info.name].state == COMMITTED
        on_remote = remote.get(info.name, False)
        entry = entries.get(info.name)
        lag = entry.lag_seconds if entry is not None and on_remote else None
        if info.name not in local:
            tiers[info.name] = _Tier("remote", source, lag)
        elif on_local and on_remote:
            tiers[info.name] = _Tier("both", source, lag)
        else:
            waiting = now - info.created if on_local else None
            tiers[info.name] = _Tier("local", source, None, waiting)
    merged.sort(key=lambda i: (i.iteration is None, i.iteration or 0, i.name))
    return merged, tiers, notes


def _tier_json(tiers: dict[str, _Tier], info: CheckpointInfo) -> dict[str, Any]:
    tier = tiers.get(info.name)
    if tier is None:
        return {}
    return {
        "tier": tier.tier,
        "tier_source": tier.source,
        "lag_seconds": None if tier.lag is None else round(tier.lag, 3),
        "waiting_seconds": None if tier.waiting is None else round(max(0.0, tier.waiting), 3),
    }


def _lag_cell(tier: _Tier) -> str:
    if tier.waiting is not None:
        return f"waiting {format_age(tier.waiting)}"
    return format_age(tier.lag)


# --------------------------------------------------------------------------- prune


_FLAG_NAMES = {
    "keep_last": "--keep",
    "keep_every": "--keep-every",
    "keep_best": "--keep-best",
    "metric": "--metric",
    "mode": "--mode",
    "keep_every_seconds": "--keep-one-every",
    "keep_recent_seconds": "--keep-recent",
    "max_total_bytes": "--max-bytes",
}


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    if args.metric is not None and args.keep_best is None:
        raise usage(f"--metric {args.metric!r} is only used with --keep-best K; add it.")
    rules = (args.keep, args.keep_every, args.keep_best, args.keep_one_every, args.keep_recent)
    if all(rule is None for rule in rules) and args.max_bytes is None:
        raise usage(
            "prune needs a rule: --keep N (the newest N), and/or --keep-every K, --keep-best K "
            "--metric M, --keep-one-every DURATION, --keep-recent DURATION, --max-bytes SIZE; "
            "e.g. --keep 3."
        )
    try:
        return build_policy(
            keep_last=args.keep,
            keep_every=args.keep_every,
            keep_best=args.keep_best,
            metric=args.metric,
            mode=args.mode,
            names=_FLAG_NAMES,
            keep_every_seconds=args.keep_one_every,
            keep_recent_seconds=args.keep_recent,
            max_total_bytes=args.max_bytes,
        )
    except ValueError as exc:
        raise usage(str(exc)) from None


def _describe(policy: RetentionPolicy) -> str:
    parts = []
    for rule in policy.rules:
        if isinstance(rule, KeepLast):
            parts.append(f"--keep {rule.count}")
        elif isinstance(rule, KeepEvery):
            parts.append(f"--keep-every {rule.every}")
        elif isinstance(rule, KeepBest):
            parts.append(f"--keep-best {rule.count} ({rule.mode} {rule.metric})")
        elif isinstance(rule, KeepEverySeconds):
            parts.append(f"--keep-one-every {rule.seconds:g}s")
        elif isinstance(rule, KeepRecent):
            parts.append(f"--keep-recent {rule.seconds:g}s")
    return " ".join(parts) or "any rule"


def _plan(
    infos: list[CheckpointInfo], policy: RetentionPolicy, retention: RetentionPlan[CheckpointInfo]
) -> list[tuple[CheckpointInfo, str]]:
    """What to delete and why, oldest first."""
    committed = committed_automatic(infos)
    doomed = {id(i) for i in retention.delete}
    over = {id(i) for i in retention.over_budget}
    stale = {id(i) for i in retention.incomplete}
    newest = committed[-1].name if committed else "?"
    budget = format_size(policy.max_bytes) if isinstance(policy, MaxTotalBytes) else ""
    plan = []
    for info in infos:  # already oldest first
        if id(info) in over:
            plan.append((info, f"oldest over --max-bytes {budget}"))
        elif id(info) in doomed:
            plan.append((info, f"not kept by {_describe(policy)}"))
        elif id(info) in stale:
            plan.append((info, f"incomplete, older than {newest}"))
    return plan


def _retention(
    storage: Storage, infos: list[CheckpointInfo], policy: RetentionPolicy
) -> RetentionPlan[CheckpointInfo]:
    """The retention plan, every checkpoint it keeps verified against its checksums first.

    A damaged one (a flipped byte keeps the size ``ls`` checks) must not count toward
    ``--keep``: otherwise prune would keep it and delete the intact older one, and the next
    run could not resume at all.
    """
    # No total: only the checkpoints kept are read, and which those are depends on the reads.
    with progress(None, "B", "verifying") as bar:

        def damage(info: CheckpointInfo) -> str | None:
            problems, _ = _verify_one(storage, info, bar)
            return "; ".join(problems) or None

        return plan_retention(infos, policy, damage, now=time.time(), remove_incomplete=True)


def _confirm(question: str) -> bool:
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _report_kept(infos: list[CheckpointInfo], retention: RetentionPlan[CheckpointInfo]) -> None:
    """Say on stderr which checkpoints are kept whatever the policy says, and why."""
    for info in infos:
        if info.state == CORRUPT:
            say(
                f"Keeping corrupt {info.name} ({info.error}); inspect it with `accelkit ckpt "
                "verify` and delete it by hand if unwanted.",
                err=True,
            )
        elif info.state == FOREIGN:
            say(
                f"Keeping {info.name}: {info.error}. accelkit deletes only what it wrote; "
                "delete it by hand if unwanted.",
                err=True,
            )
    note = accelerate_note(
        infos, "prune keeps them (accelkit deletes only what it wrote: delete by hand if unwanted);"
    )
    if note:
        say(note, err=True)
    named = _names([i for i in infos if i.state == COMMITTED and not i.is_automatic])
    if named:
        say(
            f"Keeping {named}: accelkit checkpoints saved under a name the script chose "
            "(save_state(output_dir=...)); retention (--keep, total_limit) counts and deletes "
            "only checkpoint_<n> folders. Save with ProjectConfiguration(automatic_checkpoint_"
            "naming=True) to have them rotated, or delete these by hand if unwanted.",
            err=True,
        )
    for info, why in retention.damaged:
        say(
            f"Keeping damaged {info.name} ({why}): its files do not match its manifest, so it "
            "does not count toward --keep. Inspect it with `accelkit ckpt verify` and delete it "
            "by hand if unwanted.",
            err=True,
        )
    if retention.protected is not None:
        say(
            f"Keeping {retention.protected.name}: it is the newest checkpoint that verifies, "
            "and prune never leaves a project without one.",
            err=True,
        )
    if retention.over_by:
        say(
            f"Still {format_size(retention.over_by)} ({retention.over_by} bytes) over "
            "--max-bytes after this prune: what is left may not be deleted (the newest "
            "checkpoint that verifies, and the folders named above). Raise --max-bytes, or "
            "delete some of those by hand.",
            err=True,
        )
    if retention.damaged and retention.intact is None:
        say(
            "No committed checkpoint verifies: none of them was deleted. Resume is impossible "
            "from these; restore one from a copy.",
            err=True,
        )


def _names(infos: list[CheckpointInfo]) -> str:
    """A few of ``infos``' names for one line."""
    shown = ", ".join(i.name for i in infos[:5])
    return shown + (f" and {len(infos) - 5} more" if len(infos) > 5 else "")


def _why_kept(infos: list[CheckpointInfo], retention: RetentionPlan[CheckpointInfo]) -> str:
    """``": 2 by the policy, 6 not accelkit's ..."``: why a prune that removes nothing kept
    what it kept, by reason (the lines above say more), or ``""`` where the policy alone did."""
    committed = committed_automatic(infos)
    damaged = {id(info) for info, _ in retention.damaged}
    counts = [
        (sum(id(i) not in damaged for i in committed), "kept by the policy"),
        (len(damaged), "damaged"),
        (sum(i.state == COMMITTED and not i.is_automatic for i in infos), "named by the script"),
        (sum(i.state == ACCELERATE for i in infos), "written by Hugging Face accelerate"),
        (sum(i.state == FOREIGN for i in infos), "not written by accelkit"),
        (sum(i.state == CORRUPT for i in infos), "corrupt"),
        (sum(i.state == INCOMPLETE for i in infos), "incomplete, maybe a save in flight"),
    ]
    parts = [f"{n} {why}" for n, why in counts if n]
    if len(parts) == 1 and parts[0].endswith("kept by the policy"):
        return ""
    return ": " + ", ".join(parts)


def _run_prune(args: argparse.Namespace) -> int:
    policy = _policy(args)
    storage = open_storage(args)
    root, infos, _ = collect(storage, args.path, allow_single=False)
    if not infos:
        raise nothing_found(args.path, root)
    retention = _retention(storage, infos, policy)
    plan = _plan(infos, policy, retention)
    doomed = {id(i) for i, _ in plan}
    kept = [i.name for i in infos if id(i) not in doomed]
    _report_kept(infos, retention)
    if not plan:
        say(f"Nothing to remove under {root} ({len(kept)} kept{_why_kept(infos, retention)}).")
        return 0
    total = sum(i.size_bytes for i, _ in plan)
    rows = [[i.name, i.state, format_size(i.size_bytes), why] for i, why in plan]
    title = "Would remove (dry run):" if args.dry_run else "To remove:"
    say(title)
    print(render_table(["NAME", "STATE", "SIZE", "REASON"], rows, right=["SIZE"]))
    say(f"Kept: {', '.join(kept) if kept else '(none)'}")
    if args.dry_run:
        say(f"Would free {format_size(total)} ({total} bytes); nothing was deleted.")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise usage(
                f"not deleting {len(plan)} folder(s) under {root!r} without confirmation: stdin "
                "is not a terminal. Pass --yes to delete, or --dry-run to only show the plan."
            )
        if not _confirm(f"Delete {len(plan)} folder(s), {format_size(total)}?"):
            say("Aborted; nothing was deleted.", err=True)
            return 1
    return _delete(storage, root, plan)


def _delete(storage: Storage, root: str, plan: list[tuple[CheckpointInfo, str]]) -> int:
    """Delete the plan through :mod:`~accelkit.checkpointing.commit.deletion` (what training's
    retention uses), holding the project's save lock: refused while a run saves there."""
    try:
        with pruning_lock(storage, root):
            freed, failed = _delete_locked(storage, root, plan)
    except CheckpointError as exc:  # the lock is held by a live save
        raise Fail(f"{exc} Nothing was deleted.", 1) from None
    say(f"Freed {format_size(freed)} ({freed} bytes).")
    if failed:
        say(
            "accelkit ckpt prune: error: could not remove:",
            *(f"  {line}" for line in failed),
            "Check permissions and run prune again.",
            err=True,
        )
        return 1
    return 0


def _delete_locked(
    storage: Storage, root: str, plan: list[tuple[CheckpointInfo, str]]
) -> tuple[int, list[str]]:
    freed = 0
    failed = []
    with progress(len(plan), "ckpt", "removing") as bar:
        for info, _ in plan:
            try:
                removed = delete_checkpoint(storage, root, info)
            except CheckpointError as exc:  # not inside root: stop at once
                raise Fail(str(exc), 1) from None
            except OSError as exc:
                failed.append(f"{info.path}: {exc}")
            else:
                if removed:
                    freed += info.size_bytes
                    say(f"Removed {info.name} ({format_size(info.size_bytes)})")
                else:
                    say(f"Skipped {info.name}: it was committed meanwhile.", err=True)
            bar.update(1)
    return freed, failed


# --------------------------------------------------------------------------- verify


def _verify_one(storage: Storage, info: CheckpointInfo, bar: Any) -> tuple[list[str], list[str]]:
    """``(problems as "file: detail" lines, files present but not in the manifest)``."""
    manifest = info.manifest
    if manifest is None:
        return [f"{MANIFEST_NAME}: {info.error}"], []
    storage = confine(storage, info.path)
    listing = storage.walk_files(info.path)
    extra = sorted(set(listing) - set(manifest.file_map()) - {MANIFEST_NAME})
    problems: list[str] = []
    for entry in manifest.files:
        # One entry at a time so the bar moves per file; verify_files does the checking.
        one = dataclasses.replace(manifest, files=[entry])
        try:
            found = verify_files(storage, info.path, one, sizes=listing)
            if not found:  # the checksum matches; a re-signed manifest needs the file to parse
                bad = malformed(storage, join(info.path, entry.path), entry.path)
                found = [] if bad is None else [bad]
            problems.extend(str(p) for p in found)
        except OSError as exc:
            problems.append(f"{entry.path}: cannot be read ({type(exc).__name__}: {exc})")
        bar.update(entry.size)
    return problems, extra


def _run_verify(args: argparse.Namespace) -> int:
    storage = open_storage(args)
    root, infos, single = collect(storage, args.path)
    if not infos:
        raise nothing_found(args.path, root)
    if single and infos[0].state == INCOMPLETE:
        raise Fail(
            f"{infos[0].path!r} has no {MANIFEST_NAME}: it is an incomplete checkpoint (a save "
            "that did not finish), so there is nothing to verify it against. Save again, or "
            "remove it with `accelkit ckpt prune`.",
            1,
        )
    if single and infos[0].state == FOREIGN:
        raise Fail(f"{infos[0].path!r} is {infos[0].error}; there is nothing to verify.", 1)
    todo = [i for i in infos if i.state in (COMMITTED, CORRUPT, ACCELERATE)]
    total = sum(
        i.size_bytes if i.manifest is None else i.manifest.total_size
        for i in todo
        if i.manifest is not None or i.state == ACCELERATE
    )
    results = []
    with progress(total, "B", "verifying") as bar:
        for info in infos:
            results.append(_verify_result(storage, info, bar))
    bad = sum(r["result"] == "fail" for r in results)
    note = accelerate_note(
        infos,
        "they record no checksums, so verify read every file to its end and each folder as "
        "load_state reads it;",
    )
    if args.json:
        say_json(
            {
                "root": root,
                "checked": len(todo),
                "intact": len(todo) - bad,
                "failed": bad,
                "checkpoints": results,
            }
        )
    else:
        for r in results:
            _say_result(r)
        if note:
            say(note)
    if not todo:
        raise Fail(
            f"no checkpoint to verify under {root!r} (only incomplete ones or folders that "
            "are neither accelkit's nor Hugging Face accelerate's checkpoints).",
            1,
        )
    if not args.json:
        say(f"{len(todo) - bad} of {len(todo)} checkpoint(s) intact.")
    if bad:
        say(
            f"accelkit ckpt verify: {bad} checkpoint(s) under {root!r} failed: they cannot be "
            "trusted. Load an intact one, or delete them.",
            err=True,
        )
        return 1
    return 0


def _verify_result(storage: Storage, info: CheckpointInfo, bar: Any) -> dict[str, Any]:
    """One checkpoint's verdict, as ``--json`` prints it: ``result`` is ``ok``, ``fail`` or
    ``skip``; ``files`` counts what was checked (the manifest's files and the manifest, as
    ``ls`` counts FILES), ``problems`` the failures, ``not_in_manifest`` files ignored."""
    out: dict[str, Any] = {"name": info.name, "path": info.path, "state": info.state}
    if info.state == INCOMPLETE:
        return {**out, "result": "skip", "reason": f"incomplete (no {MANIFEST_NAME})"}
    if info.state == ACCELERATE:
        return {**out, **_verify_accelerate(storage, info, bar)}
    if info.state in NOT_OURS:
        return {**out, "result": "skip", "reason": info.error}
    problems, extra = _verify_one(storage, info, bar)
    checked = len(info.manifest.files) + 1 if info.manifest is not None else 0
    return {
        **out,
        "result": "fail" if problems else "ok",
        "files": checked,
        "size_bytes": info.size_bytes,
        # Every problem counts, but a crafted manifest can list a million: 50 of them.
        "problems": at_most(problems, 50),
        "not_in_manifest": at_most(extra, 20),
    }


def _verify_accelerate(storage: Storage, info: CheckpointInfo, bar: Any) -> dict[str, Any]:
    """The verdict on a folder Hugging Face accelerate wrote (see
    :func:`~accelkit.checkpointing.interop.accelerate_format.check_accelerate`)."""
    # Deferred: reading a pickle needs torch, which `accelkit --help` must not import.
    from accelkit.checkpointing.interop.accelerate_format import check_accelerate

    check = check_accelerate(storage, info.path)
    bar.update(check.size_bytes)
    return {
        "result": "fail" if check.problems else "ok",
        "files": check.files,
        "size_bytes": check.size_bytes,
        "problems": at_most(check.problems, 50),
        "not_in_manifest": [],
        "not_parsed": at_most(check.unparsed, 20),
    }


def _say_result(r: dict[str, Any]) -> None:
    if r["result"] == "skip":
        reason = r["reason"]
        if r["state"] == INCOMPLETE:
            reason += "; not a checkpoint"
        say(f"SKIP  {r['name']}: {reason}")
        return
    if r["result"] == "fail":
        say(f"FAIL  {r['name']}", *(f"      {line}" for line in r["problems"]))
    elif r["state"] == ACCELERATE:
        say(
            f"OK    {r['name']}: {r['files']} files, {format_size(r['size_bytes'])} "
            "(accelerate: read as load_state reads it; it records no checksums)"
        )
    else:
        say(f"OK    {r['name']}: {r['files']} files, {format_size(r['size_bytes'])}")
    if r.get("not_parsed"):
        say(
            f"      read but not parsed: {', '.join(r['not_parsed'])} (pickled sampler "
            "objects, which accelkit never unpickles)"
        )
    if r["not_in_manifest"]:
        # Not part of the checkpoint (never loaded), so not a failure; worth knowing.
        say(f"      not in the manifest (ignored): {', '.join(r['not_in_manifest'])}")


# --------------------------------------------------------------------------- inspect


def _shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _state_names(
    storage: Storage, name: str, url: str, errors: list[str]
) -> dict[tuple[str, str], str]:
    """``(file, key) -> path`` for the tensors of one object-state file (optimizer, RNG...).

    The keys of such a file (``t0``, ``t1``...) mean nothing alone; its structure file names
    them. A damaged structure file is reported with the other errors and the keys are shown.
    """
    from accelkit.checkpointing.catalog.inspect import state_tensor_names

    try:
        return {(name, key): path for key, path in state_tensor_names(storage, url).items()}
    except (CheckpointError, OSError) as exc:
        errors.append(f"{name.removesuffix('.safetensors')}.json: {exc}")
        return {}


def _newest_if_project(storage: Storage, path: str) -> str:
    """A project dir or checkpoints folder stands for its newest committed checkpoint (the
    one ``load_state()`` takes), said on stderr; anything else is inspected as given. Listing
    every checkpoint's files together mixed their tensors, an incomplete save's first."""
    if not storage.isdir(path) or storage.exists(join(path, MANIFEST_NAME)):
        return path
    root = join(path, CHECKPOINTS_DIRNAME)
    if not storage.isdir(root):
        root = path
    newest = latest_checkpoint(storage, root)
    if newest is None:
        return path
    say(f"inspecting {newest.path}, the newest committed checkpoint under {path}", err=True)
    return newest.path


def _run_inspect(args: argparse.Namespace) -> int:
    from accelkit.checkpointing.catalog.inspect import read_safetensors_header, safetensors_files
    from accelkit.checkpointing.formats.dcp_metadata import has_sharded_state, sharded_tensor_infos

    storage = open_storage(args)
    path = _newest_if_project(storage, args.path.rstrip("/") or args.path)
    # Never follow a link inside what is inspected: a folder, or a file's own folder.
    folder = path if storage.isdir(path) else (path.rpartition("/")[0] or ".")
    try:
        storage = confine(storage, folder)
        files = safetensors_files(storage, path)
        sharded_infos = (
            sharded_tensor_infos(storage, path) if has_sharded_state(storage, path) else []
        )
    except CheckpointError as exc:
        raise Fail(str(exc), 1) from None
    if not files and not sharded_infos:
        raise Fail(
            f"no .safetensors file in {args.path!r}. Give a checkpoint, a save_model folder, "
            "a model.safetensors.index.json or a .safetensors file.",
            1,
        )
    headers = []
    errors: list[str] = []
    # (file, key) -> where the tensor sits in its object's state: optimizer/state/<param>/exp_avg
    names: dict[tuple[str, str], str] = {}
    with progress(len(files), "file", "reading headers") as bar:
        for name, url in files:
            try:
                headers.append(read_safetensors_header(storage, url, file=name))
            except (CheckpointError, OSError) as exc:
                errors.append(f"{name}: {exc}")
            else:
                names.update(_state_names(storage, name, url, errors))
            bar.update(1)
    # A state file's tensors in the order its structure lists them (the keys sort t0, t1, t10).
    order = {place: index for index, place in enumerate(names)}
    tensors = [
        t
        for h in headers
        for t in sorted(h.tensors, key=lambda t: order.get((t.file, t.name), len(order)))
    ] + sharded_infos

    def shown(t: Any) -> str:
        return names.get((t.file, t.name), t.name)

    if args.json:
        payload = {
            "path": args.path,
            "files": [
                {"file": h.file, "size_bytes": h.file_size, "metadata": h.metadata} for h in headers
            ],
            "tensors": [
                {
                    "name": shown(t),
                    "key": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "file": t.file,
                    "numel": t.numel,
                    "size_bytes": t.nbytes,
                }
                for t in tensors
            ],
            "errors": errors,
        }
        say_json(payload)
    else:
        rows = [
            [shown(t), t.dtype, _shape(t.shape), format_size(t.nbytes), t.file] for t in tensors
        ]
        print(render_table(["NAME", "DTYPE", "SHAPE", "SIZE", "FILE"], rows, right=["SIZE"]))
        numel = sum(t.numel for t in tensors)
        nbytes = sum(t.nbytes for t in tensors)
        say(
            f"{len(tensors)} tensors, {numel:,} elements, {format_size(nbytes)} "
            f"in {len(headers)} file(s)."
        )
    if errors:
        say(
            "accelkit ckpt inspect: error: unreadable header(s):",
            *(f"  {line}" for line in errors),
            err=True,
        )
        return 1
    return 0
