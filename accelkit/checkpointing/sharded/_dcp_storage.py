"""torch.distributed.checkpoint (DCP) plugged into accelkit's storage layer.

Imported only when sharded state is saved or loaded (DCP takes seconds to import):

- :class:`StorageFileSystem` -- DCP's ``FileSystemBase`` served by a
  :class:`~accelkit.checkpointing.storage.Storage` (every storage, durable writes, size and
  checksum of each file computed as it streams out, in ``written``).
- :class:`Writer` / :class:`Reader` -- DCP's file-system writer/reader over it; the reader
  reads ``.metadata`` through
  :func:`accelkit.checkpointing.formats.dcp_metadata.read_sharded_metadata` (an exact
  allow-list of DCP's metadata classes, then every field checked).
- :class:`SafeLoadPlanner` -- DCP's planner with ``torch.load(weights_only=True)`` for
  non-tensor values (the stock one uses ``weights_only=False``).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Generator
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
)
from typing_extensions import override

from accelkit.checkpointing.formats.dcp_metadata import read_sharded_metadata
from accelkit.checkpointing.storage import HashingWriter, Storage, WrittenFile, join

__all__ = [
    "Reader",
    "SafeLoadPlanner",
    "StorageFileSystem",
    "WriteStream",
    "Writer",
]


class WriteStream(io.RawIOBase):
    """What DCP writes into: a :class:`HashingWriter` that also answers ``tell()``."""

    def __init__(self, writer: HashingWriter) -> None:
        self._writer = writer

    @override
    def writable(self) -> bool:
        return True

    @override
    def write(self, data: Any) -> int:
        return self._writer.write(data)

    @override
    def tell(self) -> int:
        return self._writer.size

    @override
    def close(self) -> None:  # DCP closes inside the block; the block's exit commits
        super().close()


class StorageFileSystem(FileSystemBase):
    """DCP's file-system interface served by an accelkit :class:`Storage`."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.written: dict[str, WrittenFile] = {}

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        url = os.fspath(path)
        if "r" in mode:
            with self.storage.open_read(url) as stream:
                yield stream
            return
        with self.storage.open_write(url) as writer:
            yield WriteStream(writer)
        assert writer.result is not None
        self.written[url] = writer.result

    @override
    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return join(os.fspath(path), suffix)

    @override
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # Only DCP's small ``.metadata`` is renamed (from ``.metadata.tmp``): copy it atomically.
        src, dst = os.fspath(path), os.fspath(new_path)
        written = self.storage.write_bytes(dst, self.storage.read_bytes(src), atomic=True)
        self.storage.remove(src)
        self.written.pop(src, None)
        self.written[dst] = written

    @override
    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    @override
    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.storage.makedirs(os.fspath(path))

    @classmethod
    @override
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    @override
    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.storage.exists(os.fspath(path))

    @override
    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.storage.remove(os.fspath(path))


class Writer(FileSystemWriter):
    def __init__(self, storage: Storage, url: str) -> None:
        # Storage makes each file durable when it closes; DCP's own fsync would fall back to
        # os.sync() (the whole machine) on streams without a file descriptor.
        super().__init__(url, single_file_per_rank=True, sync_files=False, overwrite=True)
        self.storage_fs = StorageFileSystem(storage)
        self.fs = self.storage_fs  # type: ignore[assignment]
        self.path = url


class Reader(FileSystemReader):
    def __init__(self, storage: Storage, url: str) -> None:
        super().__init__(url)
        self.storage_fs = StorageFileSystem(storage)
        self.fs = self.storage_fs  # type: ignore[assignment]
        self.url = url
        self.path = url

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_sharded_metadata(self.storage_fs.storage, self.url)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner with non-tensor values read by ``torch.load(weights_only=True)``."""

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element as set_path

            set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
