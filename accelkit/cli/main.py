"""Entry point of the ``accelkit`` console script.

Each subcommand lives in its own module, which exposes ``register(subparsers)`` adding its
parser and setting ``func`` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from accelkit._text import escape

__all__ = ["build_parser", "main"]

# Subcommand modules, imported when the parser is built. A module that is missing (an optional
# part not installed) is skipped rather than breaking the whole command.
_SUBCOMMANDS = (
    "accelkit.cli.launch",
    "accelkit.cli.config",
    "accelkit.cli.env",
    "accelkit.cli.ckpt",
)


def _version() -> str:
    from accelkit._version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The full ``accelkit`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="accelkit",
        description="Run PyTorch training anywhere, and manage its checkpoints.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"accelkit {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``accelkit`` command; returns the process exit code (130 after Ctrl-C)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C at a prompt of `accelkit config`, or while a command starts, is the user's
        # answer, not a defect: one line, no traceback. Files are written whole under a
        # temporary name (config) or by the commit protocol (ckpt), so nothing is half done.
        print("accelkit: interrupted; stopped.", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's own usage, and for a flag of `accelerate launch` the reason it is
        # refused or the nearest accepted spelling.
        from accelkit.launch.flags import explain_unknown

        sub = getattr(args, "_parser", parser)
        # The arguments are the user's, but may come from a script or a pasted line: escaped.
        sub.error(escape(explain_unknown(unknown, sub._option_string_actions)))
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # `accelkit ckpt ls | head` closed our stdout: not an error. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:
        # A defect of ours (expected failures are reported by the subcommand): keep the
        # traceback, but its message may quote bytes of the checkpoint being read, so it is
        # escaped line by line like everything else the command prints. Exit 1, as Python's.
        lines = traceback.format_exc().splitlines()
        print("\n".join(escape(line) for line in lines), file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
