"""``accelkit ckpt sync LOCAL REMOTE``: replicate a run's checkpoints to its remote tier by hand.

For a run that ended (or was killed) before its replication queue drained: every committed
``checkpoint_<n>`` under LOCAL that REMOTE lacks is copied by the same code as the background
replicator (:class:`~accelkit.checkpointing.replication.Replicator`: files verified against
the manifest, the manifest written last, under REMOTE's run lock), retrying transient storage
errors for up to ``--retry-seconds`` per operation. Nothing is skipped; ``--keep N`` then
applies the remote retention (keep the newest N).
"""

from __future__ import annotations

import argparse
from typing import Any

from accelkit.cli._ckpt_common import add_common, command, open_storage, positive_int, say, say_json

__all__ = ["register"]


def register(actions: Any) -> None:
    """Add the ``sync`` action to ``accelkit ckpt``'s sub-parsers."""
    parser = actions.add_parser(
        "sync",
        help="copy committed checkpoints that the remote tier lacks (as replicate_to does)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    add_common(parser, "LOCAL: the run's project dir (the local tier)")
    parser.add_argument("remote", metavar="REMOTE", help="the run's replicate_to URL")
    parser.add_argument(
        "--keep", type=positive_int, default=None, help="remote retention: keep the newest N"
    )
    parser.add_argument(
        "--retry-seconds",
        type=float,
        default=120.0,
        help="give up on an operation after retrying transient errors this long (default 120)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=command("sync", _run_sync))


def _run_sync(args: argparse.Namespace) -> int:
    from accelkit.checkpointing.catalog.retention import build_policy
    from accelkit.checkpointing.replication import ReplicationReport, Replicator
    from accelkit.checkpointing.replication.replicator import remote_options
    from accelkit.checkpointing.storage import get_storage
    from accelkit.delivery.retry import RetryPolicy

    local = open_storage(args)
    options = dict(args.storage_options)
    project = args.path.rstrip("/") or args.path
    if project.rsplit("/", 1)[-1] == "checkpoints":
        project = project.rsplit("/", 1)[0]
    copied: list[ReplicationReport] = []
    replicator = Replicator(
        local,
        project,
        get_storage(args.remote, remote_options(args.remote, options)),
        args.remote,
        build_policy(keep_last=args.keep, names={"keep_last": "--keep"}),
        queue_size=1 << 30,  # by hand: nothing is skipped
        retry=RetryPolicy(deadline=args.retry_seconds),
        on_replicated=copied.append,
    )
    replicator.start(catch_up=True)
    left = replicator.close(None)
    failure = replicator.failure
    if args.json:
        say_json(
            {
                "copied": [
                    {
                        "name": r.replicated.target.rstrip("/").rsplit("/", 1)[-1],
                        "target": r.replicated.target,
                        "bytes": r.replicated.bytes,
                        "seconds": round(r.replicated.seconds, 3),
                        "already": r.replicated.already,
                    }
                    for r in copied
                ],
                "left": left,
                "error": None if failure is None else f"{type(failure).__name__}: {failure}",
            }
        )
    else:
        for r in copied:
            how = "already there" if r.replicated.already else f"{r.replicated.bytes} bytes"
            say(f"copied  {r.replicated.target} ({how}, {r.replicated.seconds:.1f} s)")
        if not copied and not left and failure is None:
            say(f"nothing to copy: {args.remote} has every committed checkpoint of {project}")
        for name in left:
            say(f"LEFT    {name}: not replicated (see the error above)", err=True)
    return 1 if left or failure is not None else 0
