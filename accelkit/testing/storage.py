"""The storage contract as a pytest suite: :class:`StorageContract`.

Subclass it in a test module and give it one fixture, ``storage_root``, that returns a storage
and the path or URL of a fresh, empty folder on it; every ``test_*`` method then runs against
that storage. See :mod:`accelkit.testing` for an example.
"""

from __future__ import annotations

from typing import Any

import pytest

from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.checksum import checksum_bytes

__all__ = ["StorageContract"]


class StorageContract:
    """What accelkit's checkpoint code expects of a storage, as pytest tests.

    A subclass provides the fixture ``storage_root() -> (storage, url)``: the storage under
    test and an empty folder on it (it need not exist yet).
    """

    @pytest.fixture
    def storage_root(self) -> tuple[Any, str]:
        """Override: ``(storage, url of a fresh empty folder)``."""
        raise NotImplementedError(
            f"{type(self).__name__} must define a `storage_root` fixture returning "
            "(storage, url of a fresh empty folder on it)."
        )

    def test_is_a_storage(self, storage_root: tuple[Any, str]) -> None:
        """The contract is :class:`~accelkit.checkpointing.storage.Storage`: the checkpoint code
        is annotated with it and calls nothing it does not declare."""
        storage, _ = storage_root
        assert isinstance(storage, Storage), (
            f"{type(storage).__name__} is not a subclass of accelkit.checkpointing.storage."
            "Storage: subclass it (or FsspecStorage, or WrappedStorage) and implement its "
            "abstract primitives."
        )

    def test_write_read_roundtrip_and_queries(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        url = join(root, "a", "b.bin")
        written = s.write_bytes(url, b"hello world")
        assert (written.size, written.checksum) == (11, checksum_bytes(b"hello world"))
        assert s.read_bytes(url) == b"hello world"
        assert s.read_bytes(url, 6, 11) == b"world"
        assert s.read_bytes(url, 6) == b"world"
        with s.open_read(url) as f:
            assert f.read(5) == b"hello"
        assert s.exists(url) and s.isfile(url) and not s.isdir(url)
        assert s.isdir(join(root, "a")) and not s.isfile(join(root, "a"))
        assert s.size(url) == 11
        assert not s.exists(join(root, "missing"))
        assert not s.isfile(join(root, "missing")) and not s.isdir(join(root, "missing"))
        with pytest.raises(FileNotFoundError):
            s.read_bytes(join(root, "missing"))

    def test_rewrite_replaces_contents(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        url = join(root, "f.bin")
        s.write_bytes(url, b"a much longer first version")
        s.write_bytes(url, b"short")
        assert s.read_bytes(url) == b"short" and s.size(url) == 5

    def test_streaming_write_hashes_what_it_writes(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        parts = [b"x" * 1000, bytearray(b"y" * 7), memoryview(b"z" * (3 << 20))]
        url = join(root, "stream.bin")
        with s.open_write(url) as w:
            for part in parts:
                w.write(part)
        data = b"".join(bytes(p) for p in parts)
        assert w.result is not None
        assert w.result.size == len(data) == s.size(url)
        assert w.result.checksum == checksum_bytes(data)
        assert s.read_bytes(url) == data

    def test_failed_streaming_write_leaves_no_file(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        url = join(root, "partial.bin")
        with pytest.raises(RuntimeError, match="boom"), s.open_write(url) as w:
            w.write(b"abc")
            raise RuntimeError("boom")
        assert not s.exists(url)

    def test_listdir_and_walk(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        s.write_bytes(join(root, "f1"), b"1")
        s.write_bytes(join(root, "d", "f2"), b"22")
        s.write_bytes(join(root, "d", "e", "f3"), b"333")
        entries = s.listdir(root)
        assert [(e.name, e.is_dir) for e in entries] == [("d", True), ("f1", False)]
        assert entries[1].size == 1
        assert s.walk_files(root) == {"d/e/f3": 3, "d/f2": 2, "f1": 1}
        with pytest.raises(FileNotFoundError):
            s.listdir(join(root, "nope"))

    def test_atomic_write_replaces_whole_and_leaves_no_temp(
        self, storage_root: tuple[Any, str]
    ) -> None:
        s, root = storage_root
        url = join(root, "accelkit.json")
        s.write_bytes(url, b"old", atomic=True)
        written = s.write_bytes(url, b"new contents", atomic=True)
        assert s.read_bytes(url) == b"new contents"
        assert (written.size, written.checksum) == (12, checksum_bytes(b"new contents"))
        assert s.walk_files(root) == {"accelkit.json": 12}

    def test_create_exclusive_creates_once(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        url = join(root, "lock", "owner.json")
        assert s.create_exclusive(url, b"first") is True
        assert s.create_exclusive(url, b"second") is False
        assert s.read_bytes(url) == b"first"

    def test_remove_and_rmtree(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        s.write_bytes(join(root, "keep", "x"), b"x")
        s.write_bytes(join(root, "gone", "sub", "y"), b"y")
        s.write_bytes(join(root, "gone", "z"), b"z")
        s.remove(join(root, "keep", "x"))
        s.remove(join(root, "keep", "x"))  # missing is fine
        assert not s.exists(join(root, "keep", "x"))
        s.rmtree(join(root, "gone"))
        s.rmtree(join(root, "gone"))  # missing is fine
        names = [e.name for e in s.listdir(root)] if s.exists(root) else []
        assert "gone" not in names
        assert not s.exists(join(root, "gone", "z"))

    def test_makedirs_is_idempotent(self, storage_root: tuple[Any, str]) -> None:
        s, root = storage_root
        s.makedirs(join(root, "m", "n"))
        s.makedirs(join(root, "m", "n"))
        s.fsync_dir(join(root, "m", "n"))
        s.write_bytes(join(root, "m", "n", "f"), b"f")
        assert s.walk_files(join(root, "m")) == {"n/f": 1}
