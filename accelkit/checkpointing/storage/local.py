"""The local disk as a checkpoint storage: :class:`LocalStorage`.

Files are written by :class:`~accelkit.checkpointing.storage._localfile.LocalFile`: with
``O_DIRECT`` through reused aligned buffers where the file system allows it (half the CPU of
buffered writes, and the page cache is left to the training data; ``ACCELKIT_DIRECT_IO=0``
turns it off), buffered with early write-back otherwise.

Durability: every file written through :meth:`~LocalStorage.open_write` or
:meth:`~LocalStorage.write_bytes` is ``fsync``-ed before it is reported written, and an atomic
write also ``fsync``-s its folder so the rename survives a power cut. A file is never rewritten
in place: writing replaces it by a new file, so a reader that maps the old one (a
``load_state`` whose tensors view the file) keeps seeing it whole.

Links: :meth:`~LocalStorage.open_read` refuses a symbolic link as the last component
(``O_NOFOLLOW``); :meth:`~LocalStorage.rmtree` removes a linked folder as a link. The complete
protection against links inside a checkpoint is :mod:`~accelkit.checkpointing.storage.confined`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import BinaryIO

from typing_extensions import override

from accelkit.checkpointing.storage._localfile import LocalFile, open_regular
from accelkit.checkpointing.storage.base import (
    Entry,
    HashingWriter,
    Sink,
    Storage,
    StoragePermissionError,
    WrittenFile,
)

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """This machine's file system; ``file://`` and ``local://`` URLs and plain paths."""

    protocol = "file"

    @property
    @override
    def is_local(self) -> bool:
        return True

    def _path(self, url: str) -> str:
        if url.startswith(("file://", "local://")):
            url = url.split("://", 1)[1]
        return os.path.abspath(os.path.expanduser(url))

    @override
    def local_path(self, url: str) -> str:
        return self._path(url)

    # ------------------------------------------------------------------ queries

    @override
    def exists(self, url: str) -> bool:
        return os.path.lexists(self._path(url))

    @override
    def isdir(self, url: str) -> bool:
        return os.path.isdir(self._path(url))

    @override
    def isfile(self, url: str) -> bool:
        return os.path.isfile(self._path(url))

    @override
    def size(self, url: str) -> int:
        return os.stat(self._path(url)).st_size

    @override
    def listdir(self, url: str) -> list[Entry]:
        out = []
        with os.scandir(self._path(url)) as it:
            for item in it:
                link = item.is_symlink()
                is_dir = item.is_dir(follow_symlinks=False)
                try:
                    size = 0 if is_dir or link else item.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    # Gone since the scan: an atomic write's temporary file renamed over its
                    # target (a manifest rewritten beside a reader). Not listed, rather than
                    # failing the listing (which made the folder look empty: "incomplete").
                    continue
                out.append(Entry(item.name, is_dir, size, link))
        return sorted(out, key=lambda e: e.name)

    @override
    def is_symlink(self, url: str) -> bool:
        return os.path.islink(self._path(url))

    @override
    def links_out(self, folder: str, relative: str) -> bool:
        parts = relative.split("/")
        return any(
            os.path.islink(os.path.join(self._path(folder), *parts[: i + 1]))
            for i in range(len(parts))
        )

    # ------------------------------------------------------------------ reading

    @override
    def open_read(self, url: str) -> BinaryIO:
        """Open ``url`` for reading bytes; a symbolic link is refused (a checkpoint must not
        point outside itself).

        Raises:
            FileNotFoundError: if there is no such file.
            PermissionError: if the file is a symbolic link.
            CorruptCheckpointError: if it is a folder, a device or a named pipe.
        """
        path = self._path(url)
        try:
            # O_NONBLOCK: opening a named pipe planted at the name (the project's save lock,
            # say) must not wait for a writer that never comes; regular files ignore it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            if os.path.islink(path):
                raise StoragePermissionError(
                    f"Refusing to read {url!r}: it is a symbolic link; a checkpoint's files "
                    "must be regular files inside it. Replace the link by the file."
                ) from exc
            raise
        return open_regular(fd, url)

    # ------------------------------------------------------------------ writing

    @override
    def makedirs(self, url: str) -> None:
        os.makedirs(self._path(url), exist_ok=True)

    @override
    def open_sink(self, url: str) -> Sink:
        path = self._path(url)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # A new file, never the old one truncated: readers that still map the old file (a load
        # in progress) keep seeing it whole.
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return LocalFile(path)

    @override
    def write_bytes(
        self, url: str, data: bytes | bytearray | memoryview, atomic: bool = False
    ) -> WrittenFile:
        """Write ``data`` to ``url`` durably; ``atomic``: write a temporary name, fsync,
        rename, fsync the folder (readers see the old file or the whole new one)."""
        if not atomic:
            return super().write_bytes(url, data)
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
        self.fsync_dir(folder)
        return WrittenFile(url, writer.result.size, writer.result.checksum)

    @override
    def create_exclusive(self, url: str, data: bytes) -> bool:
        """Create ``url`` holding ``data`` only if it does not exist (``O_CREAT | O_EXCL``)."""
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

    @override
    def fsync_dir(self, url: str) -> None:
        try:
            fd = os.open(self._path(url), os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on a folder; the data files are synced
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ deleting

    @override
    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(url))

    @override
    def rmtree(self, url: str) -> None:
        """Delete folder ``url`` (missing is fine); a symbolic link is removed as a link, its
        target is never touched."""
        path = self._path(url)
        if os.path.islink(path):
            os.remove(path)
        elif os.path.exists(path):
            shutil.rmtree(path)
