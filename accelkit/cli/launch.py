"""``accelkit launch``: run a script on N processes / machines through torch.distributed.run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from accelkit.launch import add_launch_arguments, config_from_args, launch_command


def register(subparsers: Any) -> None:
    """Add the ``launch`` subcommand."""
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on one or more processes / machines",
        description=(
            "Run SCRIPT on --num_processes processes (over --num_machines machines) with "
            "torch.distributed.run. Arguments after SCRIPT go to the script."
        ),
    )
    add_launch_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"accelkit launch: error: {exc}", file=sys.stderr)
        return 2
    return launch_command(config)
