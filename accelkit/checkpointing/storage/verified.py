"""Verified reads: the mirror of :class:`~accelkit.checkpointing.storage.HashingWriter`.

Every file of a checkpoint is read through :func:`open_verified`: a stream that hashes and
counts what it reads and, once the file is read to its end, compares size and checksum with
the file's manifest entry. Whatever goes wrong ends in a
:class:`~accelkit.checkpointing.errors.CorruptCheckpointError` naming the file: missing, a
symbolic link, a size or a checksum that disagrees with the manifest.

Public API: :func:`open_verified` -> :class:`VerifiedReader`, :func:`read_verified_bytes`,
:func:`file_checksum`, :func:`check_expected`.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, BinaryIO, Protocol

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage.base import Storage
from accelkit.checkpointing.storage.checksum import format_checksum, new_hasher, parse_checksum

__all__ = [
    "open_checkpoint_file",
    "ExpectedFile",
    "VerifiedReader",
    "check_expected",
    "file_checksum",
    "open_verified",
    "read_verified_bytes",
]

_CHUNK = 16 * 1024 * 1024


class ExpectedFile(Protocol):
    """What a read is checked against: a manifest entry's ``size`` and ``checksum``."""

    @property
    def size(self) -> int: ...

    @property
    def checksum(self) -> str: ...


def check_expected(url: str, expected: ExpectedFile, size: int, checksum: str) -> None:
    """Raise :class:`CorruptCheckpointError` if ``size``/``checksum`` differ from ``expected``
    (an empty ``checksum`` checks the size only)."""
    if size != expected.size:
        raise CorruptCheckpointError(
            f"{url}: size {size} bytes, but the manifest says {expected.size}. The file is "
            "truncated or was replaced: load another checkpoint."
        )
    if checksum and checksum != expected.checksum:
        raise CorruptCheckpointError(
            f"{url}: checksum {checksum} does not match the manifest ({expected.checksum}). The "
            "file is damaged: load another checkpoint, or, if you trust it, pass "
            "verify=False to load_state (or ProjectConfiguration(verify_checksums=False))."
        )


class VerifiedReader:
    """A binary stream over one checkpoint file that hashes and counts what it reads.

    Build it with :func:`open_verified`. Read with :meth:`read` / :meth:`readinto`, then call
    :meth:`verify` (leaving a ``with`` block normally does): it reads what is left (trailing
    bytes count too) and checks size and checksum against the expected entry.

    Attributes:
        raw: the underlying stream (for ``fileno()`` where the file is local).
        url: the file.
    """

    def __init__(
        self, raw: BinaryIO, url: str, expected: ExpectedFile | None, algorithm: str = ""
    ) -> None:
        self.raw = raw
        self.url = url
        self._expected = expected
        if expected is not None:
            algorithm, _ = parse_checksum(expected.checksum)
        self._algorithm = algorithm
        self._hasher = new_hasher(algorithm) if algorithm else None
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes, hashed. ``n < 0``: all that is left, but with an expected entry
        no more than one byte past its size (a file that grew is refused by :meth:`verify`
        without being read into memory whole)."""
        if n < 0 and self._expected is not None:
            n = max(self._expected.size - self.size, 0) + 1
        data = self.raw.read(n)
        self._seen(memoryview(data))
        return data

    def readinto(self, buffer: memoryview) -> int:
        """Fill ``buffer`` from the file (partly, at its end); returns the byte count."""
        readinto = getattr(self.raw, "readinto", None)
        if readinto is not None:
            count = int(readinto(buffer) or 0)
        else:
            chunk = self.raw.read(len(buffer))
            count = len(chunk)
            buffer[:count] = chunk
        self._seen(buffer[:count])
        return count

    def _seen(self, view: memoryview) -> None:
        self.size += len(view)
        if self._hasher is not None and len(view):
            self._hasher.update(view)

    @property
    def checksum(self) -> str:
        """``"algo:hex"`` of what was read so far (``""`` without an algorithm)."""
        if self._hasher is None:
            return ""
        return format_checksum(self._algorithm, self._hasher.hexdigest())

    def finish(self) -> tuple[int, str]:
        """Read what is left and return ``(size, checksum)`` of the whole file; with an
        expected entry, stop one byte past its size (the file disagrees already: the rest,
        however large, is not read)."""
        while True:
            want = _CHUNK
            if self._expected is not None:
                left = self._expected.size - self.size
                if left < 0:
                    return self.size, self.checksum
                # One byte past the end: a file that ends where the manifest says costs a
                # 1-byte read, not a 16 MiB buffer for nothing.
                want = min(left + 1, _CHUNK)
            if not self.read(want):
                return self.size, self.checksum

    def verify(self) -> None:
        """Read what is left, then check the whole file against the expected entry.

        Raises:
            CorruptCheckpointError: the size or checksum disagrees with the entry.
        """
        size, checksum = self.finish()
        if self._expected is not None:
            if size > self._expected.size:  # finish() stopped there: the true size is unknown
                raise CorruptCheckpointError(
                    f"{self.url}: longer than the {self._expected.size} bytes the manifest "
                    "says. The file grew or was replaced after the save: load another "
                    "checkpoint."
                )
            check_expected(self.url, self._expected, size, checksum)

    def close(self) -> None:
        """Close the underlying stream (nothing is checked)."""
        self.raw.close()

    def __enter__(self) -> VerifiedReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:
                self.verify()
        finally:
            self.close()


def open_verified(
    storage: Storage, url: str, expected: ExpectedFile | None, algorithm: str = ""
) -> VerifiedReader:
    """Open checkpoint file ``url`` for a read checked against ``expected`` (its manifest
    entry; ``None``: nothing to check, ``algorithm`` still hashes it).

    Raises:
        CorruptCheckpointError: the file is missing or a symbolic link (never followed).
    """
    return VerifiedReader(open_checkpoint_file(storage, url), url, expected, algorithm)


def open_checkpoint_file(storage: Storage, url: str) -> BinaryIO:
    """Open checkpoint file ``url`` for reading, a missing file or a link being a corrupt
    checkpoint rather than an ``OSError``.

    Raises:
        CorruptCheckpointError: the file is missing or a symbolic link (never followed).
    """
    try:
        return storage.open_read(url)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{url} is missing. Restore it, or load another checkpoint."
        ) from None
    except PermissionError as exc:  # a local symbolic link: never followed
        raise CorruptCheckpointError(str(exc)) from None


def read_verified_bytes(storage: Storage, url: str, expected: Any) -> bytes:
    """Read a whole checkpoint file, checking it against its manifest entry (if any).

    Raises:
        CorruptCheckpointError: the file is missing, a symbolic link, or disagrees with
            ``expected`` (size or checksum).
    """
    with open_verified(storage, url, expected) as reader:
        return reader.read()


def file_checksum(storage: Storage, url: str, algorithm: str) -> tuple[int, str]:
    """Stream the file at ``url`` and return ``(size, "algo:hex")``.

    Raises:
        FileNotFoundError: there is no such file.
    """
    with storage.open_read(url) as raw:
        return VerifiedReader(raw, url, None, algorithm).finish()
