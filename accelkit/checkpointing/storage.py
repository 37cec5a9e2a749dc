"""All storage access of accelkit's checkpoints: the one module that talks to fsspec.

A location is a plain string: a local path (``/runs/exp1``, ``runs/exp1``) or any fsspec URL
(``s3://bucket/run-7``, ``memory://run``, ``gcs://...``). URLs stay strings on purpose:
``pathlib.Path`` would collapse the ``//`` of ``s3://``.

Public API:

- :func:`get_storage(url, storage_options=None) <get_storage>` -- the :class:`Storage` that
  serves ``url``; ``storage_options`` go to fsspec (e.g. ``{"endpoint_url": ...,
  "key": ..., "secret": ...}`` for S3). fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL``
  and friends) and the backend's environment variables work too.
- :func:`join(base, *names) <join>` -- append path components to a path or URL.
- :class:`Storage` methods, all taking full paths/URLs of the same filesystem:
  ``exists``, ``isdir``, ``isfile``, ``size``, ``listdir`` (-> :class:`Entry` list),
  ``walk_files`` (relative path -> size, recursive), ``is_symlink``, ``links_out``,
  ``makedirs``, ``read_bytes``, ``create_exclusive``,
  ``open_read``, ``open_write`` (a :class:`HashingWriter`: streams bytes out, computes size and
  checksum on the way, and makes the file durable on close), ``write_bytes``
  (``atomic=True``: temporary name + rename + directory fsync on a local disk, a single PUT on
  an object store), ``remove``, ``rmtree``, ``invalidate``.
- :func:`sync_batch` -- a context manager: local files written inside it are ``fsync``-ed in
  background threads, overlapping the next writes; leaving it waits for all of them.

Local files are written by :class:`~accelkit.checkpointing._localfile.LocalFile`: with
``O_DIRECT`` through reused aligned buffers where the file system allows it (half the CPU of
buffered writes, and the page cache is left to the training data; ``ACCELKIT_DIRECT_IO=0``
turns it off), buffered with early write-back otherwise.

Durability: on a local disk every file written through :meth:`Storage.open_write` or
:meth:`Storage.write_bytes` is ``fsync``-ed before it is reported written, and an atomic write
also ``fsync``-s its folder so the rename survives a power cut. A local file is never
rewritten in place: writing replaces it by a new file, so a reader that maps the old one (a
``load_state`` whose tensors view the file) keeps seeing it whole. On object stores an upload is
visible only once complete, which gives the same guarantee.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, BinaryIO

import fsspec

from accelkit.checkpointing._localfile import LocalFile, finish_local, sync_batch
from accelkit.checkpointing.checksum import (
    DEFAULT_ALGORITHM,
    checksum_bytes,
    format_checksum,
    new_hasher,
)

__all__ = [
    "Entry",
    "HashingWriter",
    "Storage",
    "WrittenFile",
    "get_storage",
    "join",
    "protocol_of",
    "sync_batch",
]

# Big buffers are hashed and written in slices: to a local file of WRITE_CHUNK (a slice just
# hashed is still in the CPU cache when it is copied to the O_DIRECT stage), to other storages
# of REMOTE_WRITE_CHUNK (fewer calls into the fsspec file's buffering); a single huge write
# never needs a second copy.
WRITE_CHUNK = 1024 * 1024
REMOTE_WRITE_CHUNK = 16 * 1024 * 1024


def protocol_of(url: str) -> str:
    """Return the fsspec protocol of ``url`` (``"file"`` for a plain local path)."""
    if "://" in url:
        return url.split("://", 1)[0] or "file"
    return "file"


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
        self._file: IO[bytes] | LocalFile | None = storage._open_raw_write(url)
        self.result: WrittenFile | None = None

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` (any buffer), hashing it on the way; returns the number of bytes."""
        if self._file is None:
            raise ValueError(f"write to {self._url!r} after it was closed")
        view = memoryview(data).cast("B")
        total = len(view)
        chunk = WRITE_CHUNK if isinstance(self._file, LocalFile) else REMOTE_WRITE_CHUNK
        for start in range(0, total, chunk):
            piece = view[start : start + chunk]
            self._hasher.update(piece)
            done = 0
            while done < len(piece):  # an unbuffered write may take only part of the piece
                written = self._file.write(piece[done:])
                if not written:
                    raise OSError(f"writing {self._url!r} made no progress (0 bytes written)")
                done += written
        self._size += total
        return total

    def close(self) -> WrittenFile:
        """Flush, make durable and close; returns the :class:`WrittenFile`."""
        if self.result is not None:
            return self.result
        assert self._file is not None
        file, self._file = self._file, None
        try:
            self._storage._finish_write(file, self._deferred)
        except BaseException:
            self._discard(file)  # an open descriptor would hold the space of a full disk
            raise
        self.result = WrittenFile(
            self._url, self._size, format_checksum(self._algorithm, self._hasher.hexdigest())
        )
        return self.result

    def abort(self) -> None:
        """Close without committing and remove whatever was written."""
        if self._file is not None:
            file, self._file = self._file, None
            self._discard(file)

    def _discard(self, file: IO[bytes] | LocalFile) -> None:
        with contextlib.suppress(Exception):
            file.abort() if isinstance(file, LocalFile) else file.close()
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


class Storage:
    """One fsspec filesystem, addressed with full paths/URLs.

    Prefer :func:`get_storage`; this class does not resolve URLs of another protocol.

    Args:
        fs: the fsspec filesystem.
        protocol: its protocol as written in URLs (``"file"`` for local paths).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol

    def __repr__(self) -> str:
        return f"Storage(protocol={self.protocol!r})"

    @property
    def is_local(self) -> bool:
        """Whether this is the local disk (files are fsync-ed and renamed atomically)."""
        return self.protocol in ("file", "local")

    # ------------------------------------------------------------------ paths

    def _path(self, url: str) -> str:
        if self.is_local:
            if url.startswith(("file://", "local://")):
                url = url.split("://", 1)[1]
            return os.path.abspath(os.path.expanduser(url))
        path: str = self.fs._strip_protocol(url)
        return path

    def local_path(self, url: str) -> str | None:
        """The OS path of ``url`` on a local disk, or ``None`` for other storages."""
        return self._path(url) if self.is_local else None

    def invalidate(self, url: str | None = None) -> None:
        """Forget cached listings (object stores cache them) so the next look is fresh."""
        if self.is_local:
            return
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(None if url is None else self._path(url))

    # ------------------------------------------------------------------ queries

    def exists(self, url: str) -> bool:
        """Whether a file or folder exists at ``url``."""
        if self.is_local:
            return os.path.lexists(self._path(url))
        self.invalidate(url)
        return bool(self.fs.exists(self._path(url)))

    def isdir(self, url: str) -> bool:
        """Whether ``url`` is a folder (on object stores: a prefix with something under it)."""
        if self.is_local:
            return os.path.isdir(self._path(url))
        self.invalidate(url)
        return bool(self.fs.isdir(self._path(url)))

    def isfile(self, url: str) -> bool:
        """Whether ``url`` is a file."""
        if self.is_local:
            return os.path.isfile(self._path(url))
        self.invalidate(url)
        return bool(self.fs.isfile(self._path(url)))

    def size(self, url: str) -> int:
        """Size of the file at ``url`` in bytes."""
        if self.is_local:
            return os.stat(self._path(url)).st_size
        return int(self.fs.size(self._path(url)))

    def listdir(self, url: str) -> list[Entry]:
        """The entries directly inside folder ``url``, sorted by name.

        Raises:
            FileNotFoundError: if ``url`` is not a folder.
        """
        if self.is_local:
            path = self._path(url)
            out = []
            with os.scandir(path) as it:
                for item in it:
                    link = item.is_symlink()
                    is_dir = item.is_dir(follow_symlinks=False)
                    size = 0 if is_dir or link else item.stat(follow_symlinks=False).st_size
                    out.append(Entry(item.name, is_dir, size, link))
            return sorted(out, key=lambda e: e.name)
        self.invalidate(url)
        path = self._path(url)
        if not self.fs.isdir(path):
            raise FileNotFoundError(f"No folder at {url!r}.")
        entries = []
        for info in self.fs.ls(path, detail=True):
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if not name or str(info["name"]).rstrip("/") == path.rstrip("/"):
                continue
            is_dir = info.get("type") == "directory"
            entries.append(Entry(name, is_dir, 0 if is_dir else int(info.get("size") or 0)))
        return sorted(entries, key=lambda e: e.name)

    def walk_files(self, url: str) -> dict[str, int]:
        """Every file under folder ``url``: relative POSIX path -> size (symlinks included)."""
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

    def is_symlink(self, url: str) -> bool:
        """Whether ``url`` is a symbolic link (only possible on a local disk)."""
        return self.is_local and os.path.islink(self._path(url))

    def links_out(self, folder: str, relative: str) -> bool:
        """Whether any component of ``relative`` below ``folder`` is a symbolic link (so
        reading it could leave the folder); always False off the local disk."""
        if not self.is_local:
            return False
        parts = relative.split("/")
        return any(
            os.path.islink(os.path.join(self._path(folder), *parts[: i + 1]))
            for i in range(len(parts))
        )

    # ------------------------------------------------------------------ reading

    def open_read(self, url: str) -> BinaryIO:
        """Open ``url`` for reading bytes. A local symlink is refused (a checkpoint must not
        point outside itself).

        Raises:
            FileNotFoundError: if there is no such file.
            PermissionError: if the local file is a symbolic link.
        """
        if self.is_local:
            path = self._path(url)
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
            try:
                fd = os.open(path, flags)
            except OSError as exc:
                if os.path.islink(path):
                    raise PermissionError(
                        f"Refusing to read {url!r}: it is a symbolic link; a checkpoint's files "
                        "must be regular files inside it. Replace the link by the file."
                    ) from exc
                raise
            return os.fdopen(fd, "rb")
        stream: BinaryIO = self.fs.open(self._path(url), "rb")
        return stream

    def read_bytes(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``url`` (or of ``[start, end)``)."""
        with self.open_read(url) as f:
            if start:
                f.seek(start)
            if end is None:
                return f.read()
            return f.read(end - (start or 0))

    # ------------------------------------------------------------------ writing

    def makedirs(self, url: str) -> None:
        """Create folder ``url`` and its parents (a no-op where folders are implicit)."""
        if self.is_local:
            os.makedirs(self._path(url), exist_ok=True)
            return
        with contextlib.suppress(FileExistsError):
            self.fs.makedirs(self._path(url), exist_ok=True)

    def _open_raw_write(self, url: str) -> IO[bytes] | LocalFile:
        if self.is_local:
            path = self._path(url)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # A new file, never the old one truncated: readers that still map the old file
            # (a load in progress) keep seeing it whole.
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return LocalFile(path)
        file: IO[bytes] = self.fs.open(self._path(url), "wb")
        return file

    def _finish_write(self, file: IO[bytes] | LocalFile, deferred: bool = False) -> None:
        if not self.is_local:
            file.close()
            return
        assert isinstance(file, LocalFile)
        finish_local(file, deferred)

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
            atomic: readers see the old file or the whole new one, never a part: on a local
                disk, write a temporary name, fsync, rename, fsync the folder; on an object
                store, a single PUT.
        """
        if not atomic:
            with self.open_write(url) as writer:
                writer.write(data)
            assert writer.result is not None
            return writer.result
        if self.is_local:
            path = self._path(url)
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
            with HashingWriter(self, tmp, allow_deferred_sync=False) as writer:
                writer.write(data)
            assert writer.result is not None
            try:
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
            self.fsync_dir(url.rsplit("/", 1)[0] if "/" in url else ".")
            return WrittenFile(url, writer.result.size, writer.result.checksum)
        self.fs.pipe_file(self._path(url), bytes(data))
        return WrittenFile(url, len(data), checksum_bytes(data))

    def create_exclusive(self, url: str, data: bytes) -> bool:
        """Create the file ``url`` holding ``data`` only if it does not exist yet.

        Atomic on a local disk (``O_CREAT | O_EXCL``) and on object stores that honour a
        conditional PUT (``If-None-Match: *``: AWS S3, SeaweedFS; fsspec's ``mode="create"``).
        A filesystem without such a mode writes unconditionally (the caller reads back).

        Returns:
            ``True`` if this call created the file, ``False`` if it already existed.
        """
        if self.is_local:
            path = self._path(url)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        path = self._path(url)
        try:
            self.fs.pipe_file(path, bytes(data), mode="create")
        except FileExistsError:
            return False
        except TypeError:  # an fsspec backend without the "create" mode
            self.fs.pipe_file(path, bytes(data))
        except OSError as exc:
            if "condition" not in str(exc).lower():  # 412 Precondition Failed: it exists
                raise
            return False
        finally:
            self.invalidate(url)
        return True

    def fsync_dir(self, url: str) -> None:
        """Make a local folder's entries (new names, renames) durable; no-op elsewhere."""
        if not self.is_local:
            return
        path = self._path(url)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on a folder; the data files are synced
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ deleting

    def remove(self, url: str) -> None:
        """Delete the file at ``url`` (missing is fine)."""
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(url))
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(url))
        self.invalidate(url)

    def rmtree(self, url: str) -> None:
        """Delete folder ``url`` with everything inside it (missing is fine). A local symlink
        is removed as a link; its target is never touched."""
        if self.is_local:
            import shutil

            path = self._path(url)
            if os.path.islink(path):
                os.remove(path)
            elif os.path.exists(path):
                shutil.rmtree(path)
            return
        path = self._path(url)
        self.invalidate(url)
        if self.fs.exists(path):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)
            self.invalidate(url)
            self._remove_folder_markers(path)
        self.invalidate(url)

    def _remove_folder_markers(self, path: str) -> None:
        # Some S3 servers (SeaweedFS) keep an empty "folder" after its keys are deleted; it
        # would be listed as an empty incomplete checkpoint. Delete such markers bottom-up.
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except (FileNotFoundError, OSError):
            entries = []
        for info in entries:
            child = str(info["name"]).rstrip("/")
            if info.get("type") == "directory" and child != path.rstrip("/"):
                self._remove_folder_markers(child)
        with contextlib.suppress(Exception):
            if self.fs.exists(path):
                self.fs.rm_file(path.rstrip("/") + "/")


_STORAGES: dict[tuple[str, tuple[tuple[str, str], ...]], Storage] = {}


def get_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """Return the :class:`Storage` for ``url``.

    Args:
        url: a local path or an fsspec URL; only its protocol matters here.
        storage_options: keyword arguments for the fsspec filesystem (S3: ``endpoint_url``,
            ``key``, ``secret``, ``client_kwargs``...).

    Raises:
        ValueError: if the protocol is unknown or its package is not installed (the message
            names the package to install).
    """
    protocol = protocol_of(url)
    options = dict(storage_options or {})
    key = (protocol, tuple(sorted((k, repr(v)) for k, v in options.items())))
    cached = _STORAGES.get(key)
    if cached is not None:
        return cached
    if protocol in ("file", "local"):
        storage = Storage(fsspec.filesystem("file"), "file")
    else:
        try:
            fs = fsspec.filesystem(protocol, **options)
        except ImportError as exc:
            hint = "pip install 'accelkit[s3]'" if protocol in ("s3", "s3a") else str(exc)
            raise ValueError(
                f"Cannot open {url!r}: the package for protocol {protocol!r} is not installed. "
                f"Fix: {hint}"
            ) from exc
        except ValueError as exc:
            raise ValueError(
                f"Cannot open {url!r}: unknown storage protocol {protocol!r} ({exc})."
            ) from exc
        storage = Storage(fs, protocol)
    _STORAGES[key] = storage
    return storage
