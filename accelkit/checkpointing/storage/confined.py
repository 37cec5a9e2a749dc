"""A view of any :class:`~accelkit.checkpointing.storage.Storage` that cannot leave one folder.

A checkpoint is untrusted input: a folder downloaded from a bucket or handed over by a
colleague may hold symbolic links that point anywhere (``sharded -> /home/me/other-run``,
``model.safetensors -> /etc/shadow``). ``O_NOFOLLOW`` on a file's last path component is not
enough: a linked *folder* in the middle of the path is followed by every ``open``, ``stat`` and
``scandir``. Every read of a checkpoint therefore goes through :func:`confine`, whose view:

- refuses any path that is not the root or below it, or that has an empty, ``.`` or ``..``
  component;
- where the storage is this machine's file system (its
  :meth:`~accelkit.checkpointing.storage.Storage.local_path` is not ``None``), opens the root
  itself with ``O_NOFOLLOW | O_DIRECTORY`` (a checkpoint folder that is a link is refused)
  and every component below it relative to its parent's descriptor with ``O_NOFOLLOW``, so
  no link is followed anywhere inside the checkpoint, even if one is
  swapped in between a check and a read;
- answers ``exists``/``isdir``/``isfile``/``size``/``listdir``/``walk_files`` from ``lstat`` of
  those same descriptors, and raises :class:`LinkInCheckpointError` as soon as any component
  (or any entry of a listing) is a link.

The folders *above* the root may be links (a project under a linked scratch folder is common);
only the checkpoint itself is confined. Object stores have no links: there the view only checks
that paths stay inside the root. Writes are not confined: they go to the wrapped storage.

Public API: :func:`confine`, :class:`ConfinedStorage`, :class:`LinkInCheckpointError`,
:class:`OutsideCheckpointError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

from typing_extensions import override

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage._localfile import open_regular
from accelkit.checkpointing.storage.base import (
    Entry,
    RetryRunner,
    Storage,
    StorageIsADirectoryError,
    StorageNotADirectoryError,
    WrappedStorage,
)

__all__ = [
    "ConfinedStorage",
    "LinkInCheckpointError",
    "OutsideCheckpointError",
    "confine",
]

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
# O_NONBLOCK: opening a named pipe must not wait for a writer (it is refused right after).
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LinkInCheckpointError(CorruptCheckpointError):
    """A path inside a checkpoint goes through a symbolic link."""


class OutsideCheckpointError(CorruptCheckpointError):
    """A path that was to be read from a checkpoint is not inside it."""


def confine(storage: Storage, root: str) -> ConfinedStorage:
    """``storage`` restricted to ``root`` and what is below it, never following a link there.

    Confining an already confined view to a folder inside its root is fine (the new root must
    be inside the old one).
    """
    if isinstance(storage, ConfinedStorage):
        storage._relative(root)  # refuse a root outside the current one
        return ConfinedStorage(storage.inner, root)
    return ConfinedStorage(storage, root)


class ConfinedStorage(WrappedStorage):
    """See the module docstring; build it with :func:`confine`.

    Args:
        inner: the storage of ``root``.
        root: the folder (path or URL) that every access must stay in.
    """

    def __init__(self, inner: Storage, root: str) -> None:
        super().__init__(inner)
        self.root = root.rstrip("/") or root
        # Where the root is a folder of this machine: every access goes through descriptors.
        self._os_root = inner.local_path(self.root)

    @override
    def __repr__(self) -> str:
        return f"ConfinedStorage(protocol={self.protocol!r}, root={self.root!r})"

    # ------------------------------------------------------------------ paths

    def _relative(self, url: str) -> list[str]:
        """The components of ``url`` below the root (``[]`` for the root itself)."""
        url = url.rstrip("/") or url
        root = self.root
        if self._os_root is not None:  # "ckpt/x" and "/abs/ckpt/x" name the same file
            url, root = self.inner.local_path(url) or url, self._os_root
        if url == root:
            return []
        prefix = root if root.endswith("/") else root + "/"
        if not url.startswith(prefix):
            raise OutsideCheckpointError(
                f"Refusing to read {url!r}: it is not inside the checkpoint {self.root!r}. A "
                "checkpoint's files must all be inside its folder."
            )
        parts = url[len(prefix) :].split("/")
        if any(p in ("", ".", "..") or "\x00" in p for p in parts):
            raise OutsideCheckpointError(
                f"Refusing to read {url!r}: '..', '.' and empty path components are not "
                f"allowed inside the checkpoint {self.root!r}."
            )
        return parts

    def _link_error(self, parts: list[str]) -> LinkInCheckpointError:
        where = "/".join(parts) if parts else "the checkpoint folder itself"
        return LinkInCheckpointError(
            f"{self.root}: {where} is a symbolic link. accelkit never follows links inside a "
            "checkpoint (one could point anywhere on this machine); replace the link by the "
            "real file or folder, or copy the checkpoint with `cp -rL` if you trust it."
        )

    def _open_root(self) -> int:
        path = self._os_root
        assert path is not None
        try:
            return os.open(path, _DIR_FLAGS | _CLOEXEC)
        except OSError as exc:
            if os.path.islink(path):
                raise self._link_error([]) from None
            if exc.errno == errno.ENOTDIR:
                raise StorageNotADirectoryError(
                    errno.ENOTDIR, f"{self.root!r} is not a folder", self.root
                ) from None
            raise

    def _open_below(self, parent: int, name: str, parts: list[str], directory: bool) -> int:
        flags = (_DIR_FLAGS if directory else _FILE_FLAGS) | _CLOEXEC
        try:
            return os.open(name, flags, dir_fd=parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
                    raise self._link_error(parts) from None
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise self._link_error(parts) from None
            raise

    @contextlib.contextmanager
    def _parent_fd(self, parts: list[str]) -> Iterator[int]:
        """A descriptor of the folder holding ``parts[-1]`` (of the root if ``parts`` is
        empty), reached without following any link."""
        fd = self._open_root()
        try:
            for i, name in enumerate(parts[:-1]):
                child = self._open_below(fd, name, parts[: i + 1], directory=True)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _lstat(self, url: str) -> os.stat_result:
        parts = self._relative(url)
        if not parts:
            fd = self._open_root()
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)
        with self._parent_fd(parts) as parent:
            st = os.lstat(parts[-1], dir_fd=parent)
        if stat.S_ISLNK(st.st_mode):
            raise self._link_error(parts)
        return st

    # ------------------------------------------------------------------ queries

    @override
    def exists(self, url: str) -> bool:
        if self._os_root is None:
            self._relative(url)
            return self.inner.exists(url)
        try:
            self._lstat(url)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    @override
    def isdir(self, url: str) -> bool:
        if self._os_root is None:
            self._relative(url)
            return self.inner.isdir(url)
        try:
            return stat.S_ISDIR(self._lstat(url).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    @override
    def isfile(self, url: str) -> bool:
        if self._os_root is None:
            self._relative(url)
            return self.inner.isfile(url)
        try:
            return stat.S_ISREG(self._lstat(url).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    @override
    def size(self, url: str) -> int:
        if self._os_root is None:
            self._relative(url)
            return self.inner.size(url)
        return self._lstat(url).st_size

    @override
    def is_symlink(self, url: str) -> bool:
        if self._os_root is None:
            self._relative(url)
            return False
        try:
            self._lstat(url)
        except LinkInCheckpointError:
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        return False

    @override
    def links_out(self, folder: str, relative: str) -> bool:
        return self.is_symlink(folder.rstrip("/") + "/" + relative)

    @override
    def listdir(self, url: str) -> list[Entry]:
        """Like :meth:`Storage.listdir`; raises :class:`LinkInCheckpointError` if the folder
        or any entry in it is a symbolic link."""
        parts = self._relative(url)
        if self._os_root is None:
            return self.inner.listdir(url)
        with self._parent_fd(parts) as parent:
            fd = self._open_below(parent, parts[-1], parts, directory=True) if parts else None
            try:
                out = []
                with os.scandir(parent if fd is None else fd) as it:
                    for item in it:
                        if item.is_symlink():
                            raise self._link_error([*parts, item.name])
                        try:
                            st = item.stat(follow_symlinks=False)
                        except FileNotFoundError:  # gone since the scan (a temp file renamed)
                            continue
                        is_dir = stat.S_ISDIR(st.st_mode)
                        if not is_dir and not stat.S_ISREG(st.st_mode):
                            raise CorruptCheckpointError(
                                f"{self.root}: {'/'.join([*parts, item.name])} is not a regular "
                                "file (a pipe, socket or device); a checkpoint holds only files "
                                "and folders."
                            )
                        out.append(Entry(item.name, is_dir, 0 if is_dir else st.st_size))
            finally:
                if fd is not None:
                    os.close(fd)
        return sorted(out, key=lambda e: e.name)

    # ------------------------------------------------------------------ reading

    @override
    def open_read(self, url: str) -> BinaryIO:
        parts = self._relative(url)
        if self._os_root is None:
            return self.inner.open_read(url)
        if not parts:
            raise StorageIsADirectoryError(errno.EISDIR, f"{url!r} is a folder", url)
        with self._parent_fd(parts) as parent:
            fd = self._open_below(parent, parts[-1], parts, directory=False)
        return open_regular(fd, url)

    @override
    def open_read_retrying(self, url: str, retry: RetryRunner) -> BinaryIO:
        if self._os_root is None:
            self._relative(url)
            return self.inner.open_read_retrying(url, retry)
        return retry(f"open({url})", lambda: self.open_read(url))

    @override
    def local_path(self, url: str) -> str | None:
        self._relative(url)
        return self.inner.local_path(url)
