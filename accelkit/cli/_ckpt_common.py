"""Shared parts of the ``accelkit ckpt`` actions: errors, arguments, opening PATH, progress,
and printing.

Everything an action prints goes through :func:`say` (text, escaped line by line with
:func:`accelkit._text.escape`), :func:`say_json` (``--json``) or
:func:`~accelkit.cli._table.render_table` (whose cells are escaped), and failures through
:class:`Fail`, which :func:`command` prints with :func:`say`: folder, file, tensor and metric
names come from an untrusted checkpoint, and none of their control characters may reach the
terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from accelkit._text import escape
from accelkit._units import parse_bytes, parse_duration
from accelkit.checkpointing.catalog.listing import (
    ACCELERATE,
    CheckpointInfo,
    holds_accelerate_files,
    inspect_folder,
    list_checkpoints,
)
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.layout import (
    CHECKPOINTS_DIRNAME,
    MANIFEST_NAME,
    parse_checkpoint_name,
)
from accelkit.checkpointing.storage import (
    Storage,
    WrappedStorage,
    get_storage,
    join,
    protocol_of,
)
from accelkit.errors import WrongTypeError

__all__ = [
    "Fail",
    "accelerate_note",
    "add_common",
    "collect",
    "command",
    "duration_type",
    "nothing_found",
    "open_storage",
    "positive_int",
    "print_help",
    "progress",
    "say",
    "say_json",
    "size_type",
    "usage",
    "whole_number",
    "with_accelerate_steps",
]


class Fail(Exception):
    """Stop the command: print ``message`` to stderr and exit with ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def usage(message: str) -> Fail:
    """A usage error (exit 2)."""
    return Fail(message, 2)


# --------------------------------------------------------------------------- printing


def say(*lines: str, err: bool = False) -> None:
    """Print ``lines`` to stdout (stderr with ``err``), one per line, each escaped.

    Each line is escaped whole, its newlines included: a name holding ``\n`` or ``\r`` cannot
    start a line of its own (``OK    checkpoint_9`` under a ``FAIL``). A line already escaped,
    or holding a ``repr``, is printed unchanged (:func:`~accelkit._text.escape` is idempotent).
    """
    print("\n".join(escape(line) for line in lines), file=sys.stderr if err else sys.stdout)


def say_json(value: Any) -> None:
    """Print ``value`` as indented JSON, every non-ASCII character as a ``\\uXXXX`` escape.

    The escaping is JSON's own (``ensure_ascii``), not :func:`~accelkit._text.escape`: no raw
    control byte reaches the terminal, and a program reading the output gets the names exactly
    as they are on disk (``"\\u001b"`` decodes back to ESC), which an escape inside the
    strings would change.
    """
    print(json.dumps(value, indent=2, ensure_ascii=True))


# --------------------------------------------------------------------------- arguments


def storage_option(text: str) -> tuple[str, Any]:
    """Parse ``-o KEY=VALUE``; VALUE is JSON when it parses (numbers, objects), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:8333), got {text!r}"
        )
    try:
        parsed: Any = json.loads(value)  # numbers, booleans, {"nested": "dicts"}
    except (ValueError, RecursionError):  # "[[[[..." too deep for JSON is text as well
        parsed = value
    return key, parsed


def whole_number(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {least}, got {text!r}"
            ) from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {value}")
        return value

    return parse


positive_int = whole_number(1)
"""An argparse type: a whole number >= 1."""


def size_type(flag: str) -> Callable[[str], int]:
    """An argparse type for ``flag``: a size (``1000000``, ``5GB``, ``2GiB``) in bytes."""

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def duration_type(flag: str) -> Callable[[str], float]:
    """An argparse type for ``flag``: a duration (``3600``, ``6h``) in seconds."""

    def parse(text: str) -> float:
        try:
            return parse_duration(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_common(parser: argparse.ArgumentParser, path_help: str) -> None:
    """Add ``PATH`` and ``-o/--storage-option`` to an action's parser."""
    parser.add_argument("path", metavar="PATH", help=path_help)
    parser.add_argument(
        "-o",
        "--storage-option",
        dest="storage_options",
        metavar="KEY=VALUE",
        type=storage_option,
        action="append",
        default=[],
        help="fsspec storage option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:8333; "
        "VALUE is read as JSON when it parses, else as text",
    )


def print_help(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``accelkit ckpt`` without an action: print the help, exit 2."""
    parser.print_help(sys.stderr)
    return 2


# Exceptions that mean a bug in accelkit rather than a storage problem.
_BUGS = (TypeError, AttributeError, NameError, AssertionError, IndexError, KeyError)


def command(
    name: str, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """Wrap ``run`` so known failures print one line naming the path and return an exit code."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except Fail as exc:
            # A message may embed names from the checkpoint, raised by code far below.
            say(f"accelkit ckpt {name}: error: {exc}", err=True)
            return exc.code
        except WrongTypeError as exc:  # a TypeError accelkit raised on purpose, with its fix
            say(f"accelkit ckpt {name}: error: {exc}", err=True)
            return 2
        except (*_BUGS, BrokenPipeError):
            raise  # a defect of ours (keep the traceback), or a closed pipe (main handles it)
        except Exception as exc:
            # Storage failures (permissions, an unreachable endpoint, bad credentials) come as
            # OSError (an object store's as a StorageError, the SDK's own exception its
            # cause) or ValueError: print the message once, with the path and what to check.
            say(
                f"accelkit ckpt {name}: error: cannot access {args.path!r}: "
                f"{type(exc).__name__}: {exc}. Check the path, permissions and, for a URL, "
                "the endpoint and credentials (-o KEY=VALUE).",
                err=True,
            )
            return 2

    return wrapper


# --------------------------------------------------------------------------- shared helpers


def open_storage(args: argparse.Namespace) -> Storage:
    """The storage of ``args.path``; a usage error if nothing exists there."""
    path: str = args.path
    try:
        storage = get_storage(path, dict(args.storage_options))
    except ValueError as exc:
        raise usage(str(exc)) from None
    if not storage.exists(path):
        hint = "Check the path."
        if protocol_of(path) not in ("file", "local"):
            hint = (
                "Check the URL (bucket and prefix) and, for S3, the endpoint and credentials "
                "(-o endpoint_url=... -o key=... -o secret=...)."
            )
        raise usage(f"{path!r} does not exist. {hint}")
    return storage


def progress(total: int | None, unit: str, desc: str) -> Any:
    """A tqdm bar on a terminal; silent when stderr is piped or captured."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=desc,
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def is_single_checkpoint(storage: Storage, path: str) -> bool:
    """Whether ``path`` is one checkpoint folder rather than a folder of them or a project."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if storage.isdir(join(path, CHECKPOINTS_DIRNAME)):
        return False
    return (
        parse_checkpoint_name(name) is not None
        or storage.exists(join(path, MANIFEST_NAME))
        or holds_accelerate_files(storage, path)
    )


def with_accelerate_steps(
    storage: Storage, infos: list[CheckpointInfo]
) -> tuple[list[CheckpointInfo], list[str]]:
    """``infos`` with the STEP of each ``accelerate`` folder filled in: the optimizer steps
    read from its optimizer state (Accelerate records only its ``accumulate`` counter), and a
    line for each folder whose optimizer file was refused (its STEP stays unknown)."""
    if not any(info.state == ACCELERATE and info.step is None for info in infos):
        return infos, []
    # Deferred: reading a pickle needs torch, whose import (1-2 s) `accelkit ckpt ls` pays
    # only when a folder needs it.
    from accelkit.checkpointing.interop.accelerate_format import read_optimizer_steps

    out, refused = [], []
    for info in infos:
        if info.state == ACCELERATE and info.step is None:
            try:
                info = dataclasses.replace(info, step=read_optimizer_steps(storage, info.path))
            except (CorruptCheckpointError, OSError) as error:
                refused.append(f"{info.name}: STEP unknown: {error}")
        out.append(info)
    return out, refused


def accelerate_note(infos: list[CheckpointInfo], what: str) -> str | None:
    """The one line that explains every ``accelerate`` folder of a command's output (not one
    per folder); ``what`` says what the command does with them."""
    names = [i.name for i in infos if i.state == ACCELERATE]
    if not names:
        return None
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"accelerate: {len(names)} folder(s) written by Hugging Face accelerate's save_state "
        f"({escape(shown)}); {what} load_state() reads them as they are and `accelkit ckpt "
        "import` converts one to an accelkit checkpoint."
    )


class _CountingStorage(WrappedStorage):
    """The same storage, ticking ``bar`` once per checkpoint folder the catalog reads."""

    def __init__(self, inner: Storage, bar: Any) -> None:
        super().__init__(inner)
        self._bar = bar

    @override
    def walk_files(self, url: str) -> dict[str, int]:
        files = super().walk_files(url)
        self._bar.update(1)
        return files


def collect(
    storage: Storage, path: str, allow_single: bool = True
) -> tuple[str, list[CheckpointInfo], bool]:
    """``(root, checkpoints oldest first, whether PATH is one checkpoint)``."""
    if storage.isfile(path):
        raise usage(
            f"{path!r} is a file; expected a checkpoints folder, a project dir or a checkpoint "
            "folder."
        )
    path = path.rstrip("/") or path
    if is_single_checkpoint(storage, path):
        if not allow_single:
            parent = path.rsplit("/", 1)[0] if "/" in path else "."
            raise usage(
                f"{path!r} is one checkpoint; give the folder that holds the checkpoints "
                f"(e.g. {parent!r}) or the project dir."
            )
        return path, [inspect_folder(storage, path)], True
    candidate = join(path, CHECKPOINTS_DIRNAME)
    root = candidate if storage.isdir(candidate) else path
    with progress(None, "ckpt", "listing") as bar:
        return root, list_checkpoints(_CountingStorage(storage, bar), root), False


def nothing_found(path: str, root: str) -> Fail:
    """The exit-1 error for a folder that holds no checkpoint."""
    where = repr(path) if root == path else f"{path!r} (looked in {root!r})"
    return Fail(
        f"no checkpoint under {where}: no checkpoint_<n> folder and no folder with an "
        f"{MANIFEST_NAME}. Give the checkpoints folder or the project dir of a run.",
        1,
    )
