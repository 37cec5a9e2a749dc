"""``accelkit launch``: run a script on N processes / machines through torch.distributed.run."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from accelkit.launch.launcher import add_launch_arguments, config_from_args, launch_command
from accelkit.launch.signals import hold_stop_signals, ignore_stop_signals


def register(subparsers: Any) -> None:
    """Add the ``launch`` subcommand."""
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on one or more processes / machines",
        description=(
            "Run SCRIPT on --num_processes processes (over --num_machines machines) with "
            "torch.distributed.run. Arguments after SCRIPT go to the script. Flags are those "
            "of `accelerate launch`, spelled with underscores or dashes; settings not given "
            "come from the config file (see --config_file)."
        ),
        usage="accelkit launch [options] script [script_args ...]",
        allow_abbrev=False,
    )
    from accelkit._version import __version__

    parser.add_argument("--version", action="version", version=f"accelkit {__version__}")
    add_launch_arguments(parser)
    parser.set_defaults(func=_run, _parser=parser)


def _run(args: argparse.Namespace) -> int:
    # This process ends with the launch: from here on, a stop signal is recorded, never the
    # default action (see accelkit.launch.signals).
    hold_stop_signals()
    try:
        try:
            config = config_from_args(args)
        except ValueError as exc:
            args._parser.error(str(exc))  # the launch usage and the message; exits with 2
        return launch_command(config, at_failure=_commit_snapshots)
    finally:
        ignore_stop_signals()


def _commit_snapshots(memory: str) -> None:
    """After a failed job: commit the memory tier's newest snapshots the disk lacks (see
    :mod:`accelkit.checkpointing.memory.promote`), saying what it did."""
    try:
        if not any(os.scandir(memory)):  # no memory tier in this job: nothing to import or say
            return
    except OSError:  # the folder is gone (removed by hand): nothing to commit from
        return
    from accelkit.checkpointing.memory.promote import promote_snapshots

    def say(line: str) -> None:
        print(f"accelkit launch: {line}", file=sys.stderr, flush=True)

    promote_snapshots(memory, say)
