"""The storage contract of accelkit's checkpoints, and what every backend shares.

The contract is :class:`Storage`: a storage *is* a subclass of it, and every function of the
checkpoint code that takes a storage is annotated with it (mypy then checks that nothing is
called on a storage that the contract does not declare; ``tests/checkpointing/
test_storage_contract.py`` checks the same from the source). Each public method says in one
line what it promises.

Why a base class and not a ``typing.Protocol`` (torchtitan's ``CheckpointStorage`` is one):
the checkpoint code needs more than torchtitan's four queries. It needs a streamed write that
hashes what it writes and removes a partial file when the block fails
(:meth:`Storage.open_write` returns a :class:`HashingWriter`), and the views built on top of a
storage (:class:`~accelkit.checkpointing.storage.confined.ConfinedStorage`, the CLI's
counting view) forward a backend's primitive :meth:`Storage.open_sink`. A protocol would make
every storage re-implement those sequences, where a second copy drifts (the durability and
checksum promises are the point), and a ``runtime_checkable`` protocol checks only that the
names exist. So a backend subclasses :class:`Storage`: its abstract primitives must be
implemented (a class that lacks one cannot be instantiated, which
``accelkit.testing.StorageContract`` reports), the derived methods are written once here, and
the optional hooks have harmless defaults. The previous ``StorageProtocol``, which declared
part of this and was annotated nowhere, is gone.

- :class:`Storage` -- the contract and base class: abstract primitives (``exists``,
  ``isdir``, ``isfile``, ``size``, ``listdir``, ``open_read``, ``open_sink``,
  ``create_exclusive``, ``makedirs``, ``remove``, ``rmtree``), derived methods
  (:meth:`~Storage.walk_files`, :meth:`~Storage.read_bytes`, :meth:`~Storage.open_write`,
  :meth:`~Storage.write_bytes`) and optional hooks (``invalidate``, ``fsync_dir``,
  ``local_path``, ``is_symlink``, ``links_out``). The backends are
  :class:`~accelkit.checkpointing.storage.local.LocalStorage` and
  :class:`~accelkit.checkpointing.storage.fsspec.FsspecStorage` (S3 quirks in its subclass
  :class:`~accelkit.checkpointing.storage.fsspec.S3Storage`).
- :class:`WrappedStorage` -- a storage that forwards every primitive to another one; views such
  as :class:`~accelkit.checkpointing.storage.confined.ConfinedStorage` override what they change.
- :class:`HashingWriter` -- the stream a file is written through: hashes and counts the bytes
  on the way, makes the file durable on close, removes it when the block fails.
- :class:`Sink` -- what a backend opens for :class:`HashingWriter` to write into.
- :class:`StorageError` -- a storage failure accelkit detects itself (an ``OSError``).
- :class:`Entry`, :class:`WrittenFile`, :func:`join`, :func:`protocol_of`.

A location is a plain string: a local path or an fsspec URL. URLs stay strings on purpose:
``pathlib.Path`` would collapse the ``//`` of ``s3://``.

``accelkit.testing.StorageContract`` is the contract as a test suite: a backend passes it by
subclassing it in one line (see :mod:`accelkit.testing`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Protocol, TypeVar

from typing_extensions import override

from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM, format_checksum, new_hasher
from accelkit.errors import AccelkitError

__all__ = [
    "Entry",
    "HashingWriter",
    "RetryRunner",
    "Sink",
    "Storage",
    "StorageConnectionError",
    "StorageError",
    "StorageExistsError",
    "StorageIsADirectoryError",
    "StorageNotADirectoryError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageTimeoutError",
    "WrappedStorage",
    "WrittenFile",
    "as_storage_error",
    "basename",
    "join",
    "protocol_of",
]


def protocol_of(url: str) -> str:
    """Return the fsspec protocol of ``url`` (``"file"`` for a plain local path)."""
    if "://" in url:
        return url.split("://", 1)[0] or "file"
    return "file"


def basename(url: str) -> str:
    """The last name of a path or URL, a trailing ``/`` ignored.

    Example:
        >>> basename("s3://bucket/run/checkpoints/checkpoint_3/")
        'checkpoint_3'
    """
    return url.rstrip("/").rsplit("/", 1)[-1]


def join(base: str, *names: str) -> str:
    """Append ``names`` to ``base`` with ``/`` (also right for URLs and POSIX paths).

    Example:
        >>> join("s3://bucket/run", "checkpoints", "checkpoint_3")
        's3://bucket/run/checkpoints/checkpoint_3'
    """
    out = base
    for name in names:
        name = name.strip("/")
        if not name:
            continue
        out = out if out.endswith("/") else out + "/"
        out += name
    return out


@dataclass(frozen=True)
class Entry:
    """One entry of a folder listing."""

    name: str
    is_dir: bool
    size: int
    is_symlink: bool = False


@dataclass(frozen=True)
class WrittenFile:
    """What :class:`HashingWriter` reports once a file is durably written."""

    path: str
    size: int
    checksum: str


T = TypeVar("T")


class RetryRunner(Protocol):
    """Runs one request of a storage under a retry policy: ``retry(what, fn)`` calls ``fn``
    (again, from its start, after a transient failure) and returns its result; ``what`` names
    the request in messages (``"upload of s3://b/run/x (part 3)"``)."""

    def __call__(self, what: str, fn: Callable[[], T], /) -> T: ...


class Sink(Protocol):
    """A file being written, as a backend opens it for :class:`HashingWriter`.

    ``chunk_size`` is the slice a big buffer is written in (the writer hashes one slice, then
    writes it, so it is still in the CPU cache).
    """

    chunk_size: int

    def write(self, data: memoryview) -> int:
        """Write some of ``data`` (at least one byte); return how much."""
        ...

    def commit(self, deferred: bool) -> None:
        """Make the file complete and durable (``deferred``: may finish in a background
        :func:`~accelkit.checkpointing.storage.sync_batch`), then close it."""
        ...

    def abort(self) -> None:
        """Close without committing (the writer then removes the file)."""
        ...


class StorageError(AccelkitError, OSError):
    """A storage failed: a write that makes no progress, or a failure of an fsspec backend
    (S3 included) as accelkit passes it on.

    An ``OSError``, so ``except OSError`` catches it; never a ``ValueError``. What an fsspec
    backend raises (s3fs's ``OSError``, botocore's own errors) leaves the storage as a member
    of this family made by :func:`as_storage_error`, the backend's exception its
    ``__cause__``; its kind is kept by the subclasses below (a missing object is a
    :class:`StorageNotFoundError`, also a ``FileNotFoundError``). A local disk's own
    ``OSError`` is let through as the OS raised it.
    """


class StorageNotFoundError(StorageError, FileNotFoundError):
    """No file or folder at the URL (also a ``FileNotFoundError``)."""


class StorageExistsError(StorageError, FileExistsError):
    """The file already exists (also a ``FileExistsError``)."""


class StorageIsADirectoryError(StorageError, IsADirectoryError):
    """A folder where a file was expected (also an ``IsADirectoryError``)."""


class StorageNotADirectoryError(StorageError, NotADirectoryError):
    """A file where a folder was expected (also a ``NotADirectoryError``)."""


class StoragePermissionError(StorageError, PermissionError):
    """The storage refuses the access (also a ``PermissionError``)."""


class StorageConnectionError(StorageError, ConnectionError):
    """The connection to the storage failed or was cut (also a ``ConnectionError``)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """The storage did not answer in time (also a ``TimeoutError``)."""


# The most specific kind first: a subclass of the OSError kinds listed earlier would be
# caught by them (``ConnectionResetError`` is a ``ConnectionError``).
_KINDS: tuple[tuple[type[OSError], type[StorageError]], ...] = (
    (FileNotFoundError, StorageNotFoundError),
    (FileExistsError, StorageExistsError),
    (IsADirectoryError, StorageIsADirectoryError),
    (NotADirectoryError, StorageNotADirectoryError),
    (PermissionError, StoragePermissionError),
    (ConnectionError, StorageConnectionError),
    (TimeoutError, StorageTimeoutError),
)


def as_storage_error(exc: BaseException, what: str) -> StorageError:
    """``exc``, raised by a storage backend during ``what``, as a :class:`StorageError`.

    Raise the result ``from exc``: the backend's error stays on the chain, where
    :func:`~accelkit.delivery.failures.classify` reads botocore's error code. A
    :class:`StorageError` is returned as it is.

    Args:
        exc: what the backend raised (an ``OSError``, or a botocore or aiohttp error).
        what: the operation, naming the URL (``"open(s3://bucket/run/model.safetensors)"``).

    Returns:
        The family member of ``exc``'s kind (a ``FileNotFoundError`` becomes a
        :class:`StorageNotFoundError`), its ``errno`` kept, its message ``"<what>: <exc>"``.
    """
    if isinstance(exc, StorageError):
        return exc
    kind = next((ours for theirs, ours in _KINDS if isinstance(exc, theirs)), StorageError)
    error = kind(f"{what}: {exc or type(exc).__name__}")
    if isinstance(exc, OSError):
        error.errno = exc.errno
    return error


class HashingWriter:
    """A write-only binary stream that hashes what it writes and makes it durable on close.

    Use it as a context manager; leaving the block with an exception removes the partial file.
    After a normal exit, :attr:`result` holds the :class:`WrittenFile`.
    """

    def __init__(
        self,
        storage: Storage,
        url: str,
        algorithm: str = DEFAULT_ALGORITHM,
        allow_deferred_sync: bool = True,
    ) -> None:
        self._storage = storage
        self._deferred = allow_deferred_sync
        self._url = url
        self._algorithm = algorithm
        self._hasher = new_hasher(algorithm)
        self._size = 0
        self._sink: Sink | None = storage.open_sink(url)
        self.result: WrittenFile | None = None

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` (any buffer), hashing it on the way; returns the number of bytes."""
        if self._sink is None:
            raise ValueError(f"write to {self._url!r} after it was closed")  # io's convention
        view = memoryview(data).cast("B")
        total = len(view)
        chunk = self._sink.chunk_size
        for start in range(0, total, chunk):
            piece = view[start : start + chunk]
            self._hasher.update(piece)
            done = 0
            while done < len(piece):  # an unbuffered write may take only part of the piece
                written = self._sink.write(piece[done:])
                if not written:
                    raise StorageError(f"writing {self._url!r} made no progress (0 bytes written)")
                done += written
        self._size += total
        return total

    def close(self) -> WrittenFile:
        """Flush, make durable and close; returns the :class:`WrittenFile`."""
        if self.result is not None:
            return self.result
        assert self._sink is not None
        sink, self._sink = self._sink, None
        try:
            sink.commit(self._deferred)
        except BaseException:
            self._discard(sink)  # an open descriptor would hold the space of a full disk
            raise
        self.result = WrittenFile(
            self._url, self._size, format_checksum(self._algorithm, self._hasher.hexdigest())
        )
        return self.result

    def abort(self) -> None:
        """Close without committing and remove whatever was written."""
        if self._sink is not None:
            sink, self._sink = self._sink, None
            self._discard(sink)

    def _discard(self, sink: Sink) -> None:
        with contextlib.suppress(Exception):
            sink.abort()
        with contextlib.suppress(Exception):
            self._storage.remove(self._url)

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Storage(abc.ABC):
    """Base class of a storage backend, addressed with full paths/URLs.

    A backend implements the abstract primitives; the derived methods here are written on top
    of them. Prefer :func:`~accelkit.checkpointing.storage.get_storage`, which picks the
    backend of a URL's protocol.
    """

    protocol: str = ""
    """The protocol as written in URLs (``"file"`` for local paths)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(protocol={self.protocol!r})"

    @property
    def is_local(self) -> bool:
        """Whether files are plain files of this machine (see :meth:`local_path`)."""
        return False

    def local_path(self, url: str) -> str | None:
        """The OS path of ``url`` if it is a file of this machine's file system, else ``None``."""
        return None

    def invalidate(self, url: str | None = None) -> None:  # noqa: B027 - optional hook
        """Forget cached listings so the next look is fresh (a no-op where nothing is cached)."""

    def fsync_dir(self, url: str) -> None:  # noqa: B027 - optional hook
        """Make a folder's new entries durable (a no-op where there is nothing to sync)."""

    def is_symlink(self, url: str) -> bool:
        """Whether ``url`` is a symbolic link (never, where the storage has none)."""
        return False

    def links_out(self, folder: str, relative: str) -> bool:
        """Whether any component of ``relative`` below ``folder`` is a symbolic link (so
        reading it could leave the folder); never, where the storage has no links."""
        return False

    # ------------------------------------------------------------------ primitives

    @abc.abstractmethod
    def exists(self, url: str) -> bool:
        """Whether a file or folder exists at ``url``."""

    @abc.abstractmethod
    def isdir(self, url: str) -> bool:
        """Whether ``url`` is a folder (on object stores: a prefix with something under it)."""

    @abc.abstractmethod
    def isfile(self, url: str) -> bool:
        """Whether ``url`` is a file."""

    @abc.abstractmethod
    def size(self, url: str) -> int:
        """Size of the file at ``url`` in bytes."""

    @abc.abstractmethod
    def listdir(self, url: str) -> list[Entry]:
        """The entries directly inside folder ``url``, sorted by name.

        Raises:
            FileNotFoundError: if ``url`` is not a folder.
        """

    @abc.abstractmethod
    def open_read(self, url: str) -> BinaryIO:
        """Open ``url`` for reading bytes.

        Raises:
            FileNotFoundError: if there is no such file.
        """

    @abc.abstractmethod
    def open_sink(self, url: str) -> Sink:
        """Open a new file at ``url`` for :class:`HashingWriter` (parents created as needed).
        A file already there must stay readable, whole, until the new one is committed."""

    def open_sink_retrying(self, url: str, retry: RetryRunner) -> Sink | None:
        """A sink for ``url`` whose requests are each run under ``retry`` (an upload's parts
        re-sent from memory), or ``None`` where the backend has none (the default: the caller
        then spools the file and retries it whole)."""
        return None

    def open_read_retrying(self, url: str, retry: RetryRunner) -> BinaryIO:
        """:meth:`open_read`, with every request of the stream run under ``retry`` where the
        backend can (the default retries the open only: a read cut in the middle raises)."""
        return retry(f"open({url})", lambda: self.open_read(url))

    @abc.abstractmethod
    def create_exclusive(self, url: str, data: bytes) -> bool:
        """Create the file ``url`` holding ``data`` only if it does not exist yet.

        Returns:
            ``True`` if this call created the file, ``False`` if it already existed.
        """

    @abc.abstractmethod
    def makedirs(self, url: str) -> None:
        """Create folder ``url`` and its parents (a no-op where folders are implicit)."""

    @abc.abstractmethod
    def remove(self, url: str) -> None:
        """Delete the file at ``url`` (missing is fine)."""

    @abc.abstractmethod
    def rmtree(self, url: str) -> None:
        """Delete folder ``url`` with everything inside it (missing is fine)."""

    # ------------------------------------------------------------------ derived

    def walk_files(self, url: str) -> dict[str, int]:
        """Every file under folder ``url``: relative POSIX path -> size."""
        out: dict[str, int] = {}
        stack = [""]
        while stack:
            rel = stack.pop()
            for entry in self.listdir(join(url, rel) if rel else url):
                child = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir:
                    stack.append(child)
                else:
                    out[child] = entry.size
        return dict(sorted(out.items()))

    def read_bytes(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``url`` (or of ``[start, end)``)."""
        with self.open_read(url) as f:
            if start:
                f.seek(start)
            if end is None:
                return f.read()
            return f.read(end - (start or 0))

    def open_write(self, url: str, algorithm: str = DEFAULT_ALGORITHM) -> HashingWriter:
        """Open ``url`` for streaming writes; see :class:`HashingWriter`."""
        return HashingWriter(self, url, algorithm)

    def write_bytes(
        self, url: str, data: bytes | bytearray | memoryview, atomic: bool = False
    ) -> WrittenFile:
        """Write ``data`` to ``url`` durably and return its size and checksum.

        Args:
            url: where to write.
            data: the bytes.
            atomic: readers see the old file or the whole new one, never a part. Here the
                file is streamed through :meth:`open_write`, which is atomic where a file is
                visible only once closed (object stores); a backend where it is not overrides
                this method.
        """
        with self.open_write(url) as writer:
            writer.write(data)
        assert writer.result is not None
        return writer.result


class WrappedStorage(Storage):
    """A storage that forwards every primitive to ``inner``; subclass it to change a few.

    The derived methods (:meth:`walk_files`, :meth:`read_bytes`) are the base class's, built on
    this object's primitives, so an override of :meth:`listdir` or :meth:`open_read` applies to
    them too. Writes go to ``inner`` as they are.

    Args:
        inner: the storage to forward to.
    """

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.protocol = inner.protocol

    @property
    @override
    def is_local(self) -> bool:
        return self.inner.is_local

    @override
    def local_path(self, url: str) -> str | None:
        return self.inner.local_path(url)

    @override
    def invalidate(self, url: str | None = None) -> None:
        self.inner.invalidate(url)

    @override
    def fsync_dir(self, url: str) -> None:
        self.inner.fsync_dir(url)

    @override
    def is_symlink(self, url: str) -> bool:
        return self.inner.is_symlink(url)

    @override
    def links_out(self, folder: str, relative: str) -> bool:
        return self.inner.links_out(folder, relative)

    @override
    def exists(self, url: str) -> bool:
        return self.inner.exists(url)

    @override
    def isdir(self, url: str) -> bool:
        return self.inner.isdir(url)

    @override
    def isfile(self, url: str) -> bool:
        return self.inner.isfile(url)

    @override
    def size(self, url: str) -> int:
        return self.inner.size(url)

    @override
    def listdir(self, url: str) -> list[Entry]:
        return self.inner.listdir(url)

    @override
    def open_read(self, url: str) -> BinaryIO:
        return self.inner.open_read(url)

    @override
    def open_sink(self, url: str) -> Sink:
        return self.inner.open_sink(url)

    @override
    def open_sink_retrying(self, url: str, retry: RetryRunner) -> Sink | None:
        return self.inner.open_sink_retrying(url, retry)

    @override
    def open_read_retrying(self, url: str, retry: RetryRunner) -> BinaryIO:
        return self.inner.open_read_retrying(url, retry)

    @override
    def open_write(self, url: str, algorithm: str = DEFAULT_ALGORITHM) -> HashingWriter:
        return self.inner.open_write(url, algorithm)

    @override
    def write_bytes(
        self, url: str, data: bytes | bytearray | memoryview, atomic: bool = False
    ) -> WrittenFile:
        return self.inner.write_bytes(url, data, atomic)

    @override
    def create_exclusive(self, url: str, data: bytes) -> bool:
        return self.inner.create_exclusive(url, data)

    @override
    def makedirs(self, url: str) -> None:
        self.inner.makedirs(url)

    @override
    def remove(self, url: str) -> None:
        self.inner.remove(url)

    @override
    def rmtree(self, url: str) -> None:
        self.inner.rmtree(url)
