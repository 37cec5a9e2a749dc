"""``accelkit track``: what the trackers' journals hold, and sending what a run could not.

``accelkit track status LOGGING_DIR`` shows, per tracker journal, the entries journaled,
delivered and pending; ``accelkit track sync LOGGING_DIR [--tracker NAME]`` sends the pending
ones to the run they belong to (see :mod:`accelkit.trackers.delivery.sync`;
``--allow-outside`` lets a journal's ``run.json`` name local paths outside LOGGING_DIR). Both
take ``--json``.
Exit codes: 0 done (nothing pending), 1 something could not be sent or read, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from accelkit._text import escape

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``track`` subcommand and its actions."""
    track = subparsers.add_parser(
        "track",
        help="show and send what the trackers' journals hold",
        description=(
            "Each tracker keeps a journal of the values it is sent under "
            "LOGGING_DIR/accelkit-journal/. 'status' shows what was journaled, delivered and "
            "is pending; 'sync' sends the pending values to the run they belong to."
        ),
    )
    actions = track.add_subparsers(dest="action", metavar="ACTION")
    status = actions.add_parser(
        "status",
        help="entries journaled, delivered and pending, per tracker",
        description="Show, per tracker journal, the entries journaled, delivered and pending.",
    )
    status.add_argument("logging_dir", metavar="LOGGING_DIR", help="the run's logging directory")
    status.add_argument("--json", action="store_true", help="one JSON object per journal")
    status.set_defaults(func=_run_status)
    sync = actions.add_parser(
        "sync",
        help="send what a finished or killed run could not deliver",
        description=(
            "Send every journal's pending entries, in order with their original steps, to the "
            "run recorded in the journal, recording each as delivered right after the backend "
            "accepts it (so running it again sends nothing twice). Run it once the job ended."
        ),
    )
    sync.add_argument("logging_dir", metavar="LOGGING_DIR", help="the run's logging directory")
    sync.add_argument("--tracker", metavar="NAME", help="only this tracker's journals")
    sync.add_argument("--json", action="store_true", help="one JSON object per journal")
    sync.add_argument(
        "--allow-outside",
        action="store_true",
        help=(
            "let run.json name local paths outside LOGGING_DIR (a run folder, a W&B dir, an "
            "MLflow file store): only for a journal you wrote yourself"
        ),
    )
    sync.set_defaults(func=_run_sync)
    track.set_defaults(func=lambda args: _usage(track))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    print("accelkit track: choose an action: status or sync", file=sys.stderr)
    return 2


def _check_dir(path: str) -> bool:
    if os.path.isdir(path):
        return True
    print(
        f"accelkit track: {escape(path)} is not a folder; give the run's logging directory "
        "(the one holding accelkit-journal/).",
        file=sys.stderr,
    )
    return False


def _run_status(args: argparse.Namespace) -> int:
    from accelkit.trackers.delivery.sync import status

    if not _check_dir(args.logging_dir):
        return 2
    rows = status(args.logging_dir)
    if args.json:
        for row in rows:
            print(
                json.dumps(
                    {
                        "tracker": row.name,
                        "folder": row.folder,
                        "journaled": row.journaled,
                        "delivered": row.delivered,
                        "pending": row.pending,
                        "reference": row.reference,
                        "problems": list(row.problems),
                    }
                )
            )
    else:
        if not rows:
            print(f"No tracker journal under {escape(args.logging_dir)}.")
        for row in rows:
            print(
                f"{escape(row.name)}: {row.journaled} journaled, {row.delivered} delivered, "
                f"{row.pending} pending ({escape(row.folder)})"
            )
            for problem in row.problems:
                print(f"  problem: {escape(problem)}")
    return 1 if any(row.problems for row in rows) else 0


def _run_sync(args: argparse.Namespace) -> int:
    from accelkit.trackers.delivery.sync import sync

    if not _check_dir(args.logging_dir):
        return 2
    results = sync(args.logging_dir, args.tracker, allow_outside=args.allow_outside)
    failed = False
    for result in results:
        failed = failed or bool(result.error) or result.pending > 0
        if args.json:
            print(json.dumps(result.__dict__))
            continue
        sent = (
            f"sent {result.sent} entries (seq {result.first_seq}..{result.last_seq})"
            if result.sent
            else "nothing to send"
        )
        line = f"{escape(result.name)}: {sent}; {result.pending} pending ({escape(result.folder)})"
        print(line)
        if result.error:
            print(f"  stopped: {escape(result.error)}")
        for problem in result.problems:
            print(f"  problem: {escape(problem)}")
    if not results and not args.json:
        which = f" for tracker {escape(args.tracker)}" if args.tracker else ""
        print(f"No tracker journal{which} under {escape(args.logging_dir)}.")
    return 1 if failed else 0
