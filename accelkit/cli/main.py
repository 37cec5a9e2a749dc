"""Entry point of the ``accelkit`` console script.

Each subcommand lives in its own module, which exposes ``register(subparsers)`` adding its
parser and setting ``func`` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
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
    "accelkit.cli.track",
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
    _own_parser_default(parser)
    return parser


def _own_parser_default(parser: argparse.ArgumentParser) -> None:
    """Give every parser of the tree the default ``_parser=<itself>``.

    argparse copies the innermost sub-parser's defaults over its parents', so after parsing,
    ``args._parser`` is the parser of the (sub)command the user typed: an unknown flag is then
    reported with that command's usage and matched against that command's flags
    (``accelkit ckpt verify X --jsn`` suggests ``--json``, not the top level's ``--version``).
    """
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _own_parser_default(sub)


class _CtrlC:
    """Python's own SIGINT handler (raise ``KeyboardInterrupt``) that also remembers the
    signal came: an import it interrupts can fail later with another error (numpy's
    "cannot load module more than once per process" when torch imports it again), which is
    the Ctrl-C all the same."""

    seen = False

    @classmethod
    def handler(cls, signum: int, frame: object) -> None:
        cls.seen = True
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``accelkit`` command; returns the process exit code (130 after Ctrl-C)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if (
        argv is None
        and main_thread
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _CtrlC.handler)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C at a prompt of `accelkit config`, or while a command starts, is the user's
        # answer, not a defect: one line, no traceback. Files are written whole under a
        # temporary name (config) or by the commit protocol (ckpt), so nothing is half done.
        return _stopped()
    except Exception as error:
        if _interrupted(error):
            return _stopped()
        raise
    finally:
        if argv is None and threading.current_thread() is threading.main_thread():
            # The command's work is done and its status chosen: a Ctrl-C now, while the
            # interpreter shuts down, would kill the process by SIGINT instead (exit -2, a
            # status the command never chose).
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stopped() -> int:
    print("accelkit: interrupted; stopped.", file=sys.stderr)
    return 130


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` is a Ctrl-C in disguise: Python wraps a KeyboardInterrupt that lands
    in some places (a class body's ``__set_name__`` while a module is imported) in a
    RuntimeError whose cause is the interrupt, and an interrupted import may fail again
    later with an error of its own (:class:`_CtrlC`)."""
    if _CtrlC.seen:
        return True
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's own usage, and for a flag of `accelerate launch` the reason it is
        # refused or the nearest accepted spelling.
        from accelkit.launch.flags import explain_unknown

        sub = getattr(args, "_parser", parser)
        # Only `accelkit launch` takes `accelerate launch`'s flags, so only it explains a
        # refused one (`ckpt ls --use_deepspeed` is a typo there, not a DeepSpeed request).
        launch = sub.prog.split()[1:2] == ["launch"]
        # The arguments are the user's, but may come from a script or a pasted line: escaped.
        message = explain_unknown(unknown, sub._option_string_actions, refusals=launch)
        sub.error(escape(message))
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
    except Exception as error:
        if _interrupted(error):
            return _stopped()
        # A defect of ours (expected failures are reported by the subcommand): keep the
        # traceback, but its message may quote bytes of the checkpoint being read, so it is
        # escaped line by line like everything else the command prints. Exit 1, as Python's.
        lines = traceback.format_exc().splitlines()
        print("\n".join(escape(line) for line in lines), file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
