"""The files a built-in tracker writes in its run folder: never followed, never blocked on.

A run folder may come from elsewhere (a copied project, a tarball, a colleague's disk), so what
sits where a tracker file should be is untrusted: a symbolic link would send the writes outside
the logging directory, a named pipe would block the job for ever, a device or a folder would
take or give bytes that are not a log. Every file the jsonl and TensorBoard trackers open,
create or replace goes through this module: opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked
with ``fstat`` once open, created with ``O_EXCL``, or replaced by a rename (which replaces a
link, never follows it). Anything but a regular file is refused with a
:class:`TrackerFileError` naming the path, what is there, and the fix.

What is read back is untrusted too: :func:`read_lines` reads a file line by line in bounded
pieces (a line longer than the reader's limit is never held whole: a 2 GiB file without a
newline costs a megabyte, not 4 GB), and :func:`inside` says whether a path read from such a
file stays in the logging directory.

The logging directory itself is the user's choice and may be a link; the run folders under it
(``run_name``) and the files in them are accelkit's and are never followed.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable, Iterator
from typing import IO

from accelkit._text import short
from accelkit.errors import AccelkitError

__all__ = [
    "TrackerFileError",
    "check_regular",
    "create_exclusive",
    "inside",
    "make_run_folder",
    "open_append",
    "open_regular",
    "read_lines",
    "same_path",
    "write_text",
]

# What an open of a link (O_NOFOLLOW), a pipe without a reader (O_NONBLOCK), a device without
# its hardware or a folder opened for writing fails with: the path is then described from lstat.
_NOT_A_FILE_ERRNOS = {errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EISDIR, errno.EMLINK}
# No system opens a longer path; realpath's cost grows with the square of a path's parts.
_MAX_PATH = 4096
# How much of an over-long line is read at a time (then handed to ``spill``, never kept).
_CHUNK = 2**20
_SEEK_DATA: int | None = getattr(os, "SEEK_DATA", None)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class TrackerFileError(AccelkitError, OSError):
    """Something other than a regular file (or a real folder) is where a tracker writes, or a
    path read from an untrusted file (a journal's ``run.json``) leads outside the logging
    directory.

    Raised by the jsonl and TensorBoard trackers (``start``, ``store_init_configuration``), by
    ``read_jsonl`` and by ``accelkit track sync``; the hub reports it once and skips the
    tracker, like any other failure.
    """


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a regular file"


def _describe(path: str) -> str:
    """What is at ``path`` (not following a link), in words; a link's target is named."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "not a regular file"
    kind = _kind(mode)
    if stat.S_ISLNK(mode):
        try:
            kind += f" to {short(os.readlink(path), 200)}"
        except OSError:
            pass
    return kind


def _refusal(path: str, what: str, expected: str, role: str) -> TrackerFileError:
    return TrackerFileError(
        f"{short(path, 300)} is {what}, not {expected}: it is where {role}, and trackers "
        "never follow links nor write into pipes, devices or folders (the run folder may come "
        "from a copied project or an archive). Remove or rename it, or log to another "
        "logging_dir or run name, and start again."
    )


def same_path(recorded: object, path: str) -> bool:
    """Whether ``recorded`` (a path from a checkpoint: untrusted) names ``path``.

    Cheap for any value: a non-string, a string holding a NUL or one longer than any path
    is simply not ``path``.
    """
    if not isinstance(recorded, str) or "\x00" in recorded or len(recorded) > _MAX_PATH:
        return False
    return os.path.normcase(os.path.realpath(recorded)) == os.path.normcase(os.path.realpath(path))


def inside(root: str, path: object) -> bool:
    """Whether ``path`` (untrusted: read from a file) names ``root`` or a place under it.

    A relative ``path`` is taken from the current folder, as a backend opening it would. Links
    are resolved (one under ``root`` leading out is outside); a non-string, a string holding a
    NUL or one longer than any path is not inside.

    Args:
        root: the folder (the user's logging directory; may itself be a link).
        path: the path to check.
    """
    if not isinstance(path, str) or "\x00" in path or len(path) > _MAX_PATH:
        return False
    top = os.path.normcase(os.path.realpath(root))
    where = os.path.normcase(os.path.realpath(path))
    return where == top or where.startswith(top.rstrip(os.sep) + os.sep)


def read_lines(
    file: io.BufferedReader, limit: int, spill: Callable[[bytes], None] | None = None
) -> Iterator[tuple[bytes | None, bool]]:
    """Each line of ``file`` (opened in binary) and whether it ends with a newline.

    The one reader of line files that may be damaged or hostile (journal segments, jsonl
    rows). Memory stays bounded by ``limit`` whatever the file holds: a line longer than
    ``limit`` bytes is never held whole; its bytes go to ``spill`` (if given) a megabyte at a
    time and ``None`` is yielded in its place. Without ``spill``, the holes of a sparse file
    in such a line are skipped, not read (a 2 GiB hole costs no time either).

    Args:
        file: the file (a regular file: buffered and seekable).
        limit: the longest line returned (longer ones are damaged lines).
        spill: receives an over-long line's bytes, piece by piece (``None``: dropped).
    """
    while True:
        line = file.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line, line.endswith(b"\n")
            continue
        if spill is not None:
            spill(line)
        del line
        complete = False
        while not complete:
            if spill is None and not _skip_hole(file):
                break
            # One system call per megabyte (``readline`` would make one per 8 KiB buffer);
            # what follows the line's newline is given back by seeking.
            piece = file.read1(_CHUNK)
            if not piece:
                break
            end = piece.find(b"\n")
            if end >= 0:
                if end + 1 < len(piece):
                    file.seek(end + 1 - len(piece), os.SEEK_CUR)
                piece = piece[: end + 1]
                complete = True
            if spill is not None:
                spill(piece)
        yield None, complete


def _skip_hole(file: io.BufferedReader) -> bool:
    """Move past a hole of a sparse file (zeros never stored: no newline in them) at the
    current position; ``False`` (at the end of the file) when only a hole is left. Where the
    system cannot tell (no ``SEEK_DATA``), nothing moves."""
    if _SEEK_DATA is None:
        return True
    position = file.tell()
    try:
        data = os.lseek(file.fileno(), position, _SEEK_DATA)
    except OSError as error:
        if error.errno != errno.ENXIO:
            return True
        file.seek(0, os.SEEK_END)  # ENXIO: only a hole after ``position``, up to the end
        return False
    if data > position:
        file.seek(data)
    return True


def check_regular(path: str, role: str) -> bool:
    """Whether a regular file is at ``path`` (``False``: nothing is there).

    Args:
        path: the file.
        role: what the file is for, for the error (``"the jsonl tracker appends its rows"``).

    Raises:
        TrackerFileError: something else is there (a link, a pipe, a device, a folder).
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise _refusal(path, _describe(path), "a regular file", role)
    return True


def make_run_folder(logging_dir: str, run_name: str, role: str) -> str:
    """Create ``<logging_dir>/<run_name>`` one folder at a time, refusing any that is a link.

    Args:
        logging_dir: the user's logging directory (may itself be a link: the user chose it).
        run_name: the run's sub-folders (``""``: the logging directory itself).
        role: what the folder is for, for the error.

    Returns:
        The run folder's path.

    Raises:
        TrackerFileError: a folder of ``run_name`` is a link or not a folder.
    """
    os.makedirs(logging_dir, exist_ok=True)
    folder = logging_dir
    for part in [p for p in run_name.replace(os.sep, "/").split("/") if p not in ("", ".")]:
        folder = os.path.join(folder, part)
        try:
            os.mkdir(folder)
        except FileExistsError:
            pass
        mode = os.lstat(folder).st_mode
        if not stat.S_ISDIR(mode):
            raise _refusal(folder, _describe(folder), "a folder", role)
    return os.path.join(logging_dir, run_name)


def open_regular(path: str, flags: int, role: str, *, follow: bool = False) -> int:
    """Open ``path`` as a regular file and return its descriptor (blocking, close-on-exec).

    The path is checked before opening (so no device is ever opened), opened with
    ``O_NONBLOCK`` (a pipe swapped in meanwhile does not block) and ``O_NOFOLLOW`` (unless
    ``follow``), and checked again with ``fstat``.

    Args:
        path: the file.
        flags: ``os.O_RDONLY``, ``os.O_WRONLY | os.O_APPEND | os.O_CREAT``, ...
        role: what the file is for, for the error.
        follow: follow a link to a regular file (for reading a file the user names).

    Raises:
        TrackerFileError: not a regular file.
        OSError: the file cannot be opened (missing, no permission, ...).
    """
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise _refusal(path, _describe(path), "a regular file", role)
    flags |= _O_NONBLOCK | _O_CLOEXEC | (0 if follow else _O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno in _NOT_A_FILE_ERRNOS:
            raise _refusal(path, _describe(path), "a regular file", role) from None
        raise
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise _refusal(path, _kind(mode), "a regular file", role)
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_append(path: str, role: str) -> IO[str]:
    """Open (or create) ``path`` to append UTF-8 text, after ending a torn last line.

    A last line without its newline (a crash while it was written) is ended first, so the
    first line appended now never continues it.

    Raises:
        TrackerFileError: not a regular file.
    """
    descriptor = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, role)
    try:
        if ends_torn(descriptor):
            os.write(descriptor, b"\n")
    except BaseException:
        os.close(descriptor)
        raise
    return open(descriptor, "a", encoding="utf-8")


def ends_torn(descriptor: int) -> bool:
    """Whether the open file is not empty and does not end with a newline."""
    size = os.fstat(descriptor).st_size
    return size > 0 and os.pread(descriptor, 1, size - 1) != b"\n"


def write_text(path: str, text: str, role: str) -> None:
    """Write ``text`` to ``path`` (created or truncated), refusing anything but a regular file.

    Raises:
        TrackerFileError: not a regular file.
    """
    descriptor = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, role)
    with open(descriptor, "w", encoding="utf-8") as file:
        file.write(text)


def create_exclusive(path: str) -> tuple[int, str]:
    """Create a new file at ``path`` (or ``path-1`` ... ``path-999`` if taken); never follows.

    Returns:
        The descriptor (open for writing) and the path created.

    Raises:
        FileExistsError: every one of those names is taken.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    candidate = path
    for attempt in range(1, 1001):
        try:
            return os.open(candidate, flags, 0o666), candidate
        except FileExistsError:
            candidate = f"{path}-{attempt}"
    raise FileExistsError(
        errno.EEXIST, f"{path} and {path}-1 ... {path}-999 are all taken; remove some", path
    )
