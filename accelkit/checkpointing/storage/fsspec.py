"""Any fsspec filesystem as a checkpoint storage: :class:`FsspecStorage`, and :class:`S3Storage`
for the quirks of S3 servers. The one module of accelkit that imports fsspec.

An upload to an object store is visible only once complete, so a streamed write is already
atomic there; listings may be cached by the filesystem, so every query forgets the cache of
its path first (a checkpoint written by another process must be seen).

The storage's methods are the boundary of the backend's errors: whatever the filesystem raises
(s3fs's ``OSError``, botocore's own errors) leaves them as a :class:`~accelkit.checkpointing.
storage.StorageError` of the same kind (:func:`~accelkit.checkpointing.storage.base.
as_storage_error`), the backend's error its ``__cause__``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import IO, Any, BinaryIO, cast

import fsspec
from typing_extensions import override

from accelkit.checkpointing.storage._s3io import MultipartSink, RangedReader, no_retry
from accelkit.checkpointing.storage.base import (
    Entry,
    RetryRunner,
    Sink,
    Storage,
    StorageError,
    StorageNotFoundError,
    WrittenFile,
    as_storage_error,
)
from accelkit.checkpointing.storage.checksum import checksum_bytes

__all__ = ["FsspecStorage", "S3Storage", "fsspec_storage"]

# Big buffers are handed to the fsspec file in slices of this size: fewer calls into its
# buffering than small slices, and a single huge write never needs a second copy.
REMOTE_WRITE_CHUNK = 16 * 1024 * 1024


@contextlib.contextmanager
def _boundary(what: str) -> Iterator[None]:
    """Raise what the filesystem raises inside the block as a :class:`StorageError` of its
    kind, chained ``from`` it (one of ours passes as it is)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        raise as_storage_error(exc, what) from exc


class _FileSink:
    """An fsspec file opened for writing, as a :class:`~accelkit.checkpointing.storage.base.
    Sink`: the upload completes on close."""

    chunk_size = REMOTE_WRITE_CHUNK

    def __init__(self, file: IO[bytes], url: str) -> None:
        self._file = file
        self._url = url

    def write(self, data: memoryview) -> int:
        with _boundary(f"write to {self._url}"):
            return self._file.write(data)

    def commit(self, deferred: bool) -> None:
        with _boundary(f"upload of {self._url}"):
            self._file.close()

    def abort(self) -> None:
        with _boundary(f"abort of {self._url}"):
            self._file.close()


class FsspecStorage(Storage):
    """One fsspec filesystem, addressed with full URLs.

    Args:
        fs: the fsspec filesystem.
        protocol: its protocol as written in URLs.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol

    def _path(self, url: str) -> str:
        path: str = self.fs._strip_protocol(url)
        return path

    @override
    def invalidate(self, url: str | None = None) -> None:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(None if url is None else self._path(url))

    # ------------------------------------------------------------------ queries

    @override
    def exists(self, url: str) -> bool:
        self.invalidate(url)
        with _boundary(f"exists({url})"):
            return bool(self.fs.exists(self._path(url)))

    @override
    def isdir(self, url: str) -> bool:
        self.invalidate(url)
        with _boundary(f"isdir({url})"):
            return bool(self.fs.isdir(self._path(url)))

    @override
    def isfile(self, url: str) -> bool:
        self.invalidate(url)
        with _boundary(f"isfile({url})"):
            return bool(self.fs.isfile(self._path(url)))

    @override
    def size(self, url: str) -> int:
        with _boundary(f"size({url})"):
            return int(self.fs.size(self._path(url)))

    @override
    def listdir(self, url: str) -> list[Entry]:
        self.invalidate(url)
        with _boundary(f"listdir({url})"):
            return self._listdir(url)

    def _listdir(self, url: str) -> list[Entry]:
        path = self._path(url)
        if not self.fs.isdir(path):
            raise StorageNotFoundError(f"No folder at {url!r}.")
        entries = []
        for info in self.fs.ls(path, detail=True):
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if not name or str(info["name"]).rstrip("/") == path.rstrip("/"):
                continue
            is_dir = info.get("type") == "directory"
            entries.append(Entry(name, is_dir, 0 if is_dir else int(info.get("size") or 0)))
        return sorted(entries, key=lambda e: e.name)

    # ------------------------------------------------------------------ reading

    @override
    def open_read(self, url: str) -> BinaryIO:
        with _boundary(f"open({url})"):
            stream: BinaryIO = self.fs.open(self._path(url), "rb")
        return stream

    # ------------------------------------------------------------------ writing

    @override
    def makedirs(self, url: str) -> None:
        with _boundary(f"makedirs({url})"), contextlib.suppress(FileExistsError):
            self.fs.makedirs(self._path(url), exist_ok=True)

    @override
    def open_sink(self, url: str) -> Sink:
        with _boundary(f"open({url}) for writing"):
            return _FileSink(self.fs.open(self._path(url), "wb"), url)

    @override
    def write_bytes(
        self, url: str, data: bytes | bytearray | memoryview, atomic: bool = False
    ) -> WrittenFile:
        """Write ``data`` to ``url``; ``atomic``: as a single PUT."""
        if not atomic:
            return super().write_bytes(url, data)
        with _boundary(f"upload of {url}"):
            self.fs.pipe_file(self._path(url), bytes(data))
        return WrittenFile(url, len(data), checksum_bytes(data))

    @override
    def create_exclusive(self, url: str, data: bytes) -> bool:
        """Create ``url`` holding ``data`` only if it does not exist, with fsspec's
        ``mode="create"``; a filesystem without that mode writes unconditionally (the caller
        reads back)."""
        with _boundary(f"create_exclusive({url})"):
            try:
                self.fs.pipe_file(self._path(url), bytes(data), mode="create")
            except FileExistsError:
                return False
            except TypeError:  # an fsspec backend without the "create" mode
                self.fs.pipe_file(self._path(url), bytes(data))
            finally:
                self.invalidate(url)
        return True

    # ------------------------------------------------------------------ deleting

    @override
    def remove(self, url: str) -> None:
        with _boundary(f"remove({url})"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(url))
        self.invalidate(url)

    @override
    def rmtree(self, url: str) -> None:
        path = self._path(url)
        self.invalidate(url)
        with _boundary(f"rmtree({url})"):
            if self.fs.exists(path):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(path, recursive=True)
                self.invalidate(url)
                self._after_rmtree(path)
        self.invalidate(url)

    def _after_rmtree(self, path: str) -> None:
        """What a backend must clean up after a recursive delete of ``path`` (nothing here)."""


class S3Storage(FsspecStorage):
    """S3 and S3-compatible servers (AWS, SeaweedFS, MinIO) through s3fs.

    Checkpoint files are written as multipart uploads whose parts go out concurrently and are
    retried one by one, and read with concurrent ranged GETs straight into the caller's buffer
    (:mod:`~accelkit.checkpointing.storage._s3io`): a save and a load run at the speed of the
    client's own bulk transfers.

    Two quirks are handled here:

    - :meth:`create_exclusive` is a conditional PUT (``If-None-Match: *``); a server that finds
      the key already there answers 412 Precondition Failed. s3fs raises ``FileExistsError``
      when the answer names the ``If-None-Match`` condition, and a plain ``OSError`` caused by
      botocore's ``ClientError`` when it does not (SeaweedFS): that error's code or HTTP status
      is read, never its message.
    - some servers (SeaweedFS) keep an empty "folder" after its keys are deleted; it would be
      listed as an empty incomplete checkpoint, so :meth:`rmtree` deletes such markers.
    """

    @override
    def open_sink(self, url: str) -> Sink:
        with _boundary(f"open({url}) for writing"):
            return MultipartSink(self.fs, self._path(url), no_retry)

    @override
    def open_sink_retrying(self, url: str, retry: RetryRunner) -> Sink | None:
        with _boundary(f"open({url}) for writing"):
            return MultipartSink(self.fs, self._path(url), retry)

    @override
    def open_read(self, url: str) -> BinaryIO:
        with _boundary(f"open({url})"):
            return cast(BinaryIO, RangedReader(self.fs, self._path(url), no_retry))

    @override
    def open_read_retrying(self, url: str, retry: RetryRunner) -> BinaryIO:
        with _boundary(f"open({url})"):
            return cast(BinaryIO, RangedReader(self.fs, self._path(url), retry))

    @override
    def create_exclusive(self, url: str, data: bytes) -> bool:
        try:
            return super().create_exclusive(url, data)
        except OSError as exc:
            if not _precondition_failed(exc):
                raise
            return False

    @override
    def _after_rmtree(self, path: str) -> None:
        # Bottom-up: a marker's children first.
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except (FileNotFoundError, OSError):
            entries = []
        for info in entries:
            child = str(info["name"]).rstrip("/")
            if info.get("type") == "directory" and child != path.rstrip("/"):
                self._after_rmtree(child)
        with contextlib.suppress(Exception):
            if self.fs.exists(path):
                self.fs.rm_file(path.rstrip("/") + "/")


_PRECONDITION_FAILED = 412


def _precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or the botocore ``ClientError`` on its chain of causes: s3fs raises
    it from that, and the storage's boundary from s3fs's) is the server's 412 Precondition
    Failed, read from the error's code and HTTP status."""
    todo: list[BaseException | None] = [exc]
    seen: list[BaseException] = []
    while todo and len(seen) < 8:
        error = todo.pop(0)
        if error is None or any(error is old for old in seen):
            continue
        seen.append(error)
        todo += [error.__cause__, error.__context__]
        response = getattr(error, "response", None)  # botocore's ClientError.response
        if not isinstance(response, Mapping):
            continue
        code = str((response.get("Error") or {}).get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", str(_PRECONDITION_FAILED)):
            return True
        if status == _PRECONDITION_FAILED:
            return True
    return False


def fsspec_storage(protocol: str, options: Mapping[str, Any]) -> FsspecStorage:
    """The storage of fsspec's filesystem for ``protocol``: :class:`S3Storage` for S3,
    :class:`FsspecStorage` otherwise.

    Raises:
        ImportError: if the filesystem's package is not installed (fsspec's own).
        ValueError: if fsspec knows no such protocol (fsspec's own).
    """
    fs = fsspec.filesystem(protocol, **options)
    return (S3Storage if protocol in ("s3", "s3a") else FsspecStorage)(fs, protocol)
