"""Storage conformance: the same contract on a local disk, ``memory://`` and a real S3 server."""

from __future__ import annotations

import os

import pytest

from accelkit.checkpointing.checksum import checksum_bytes
from accelkit.checkpointing.storage import get_storage, join, protocol_of, sync_batch
from tests.checkpointing.conftest import Root


def test_write_read_roundtrip_and_queries(root: Root) -> None:
    s = root.storage
    url = join(root.url, "a", "b.bin")
    written = s.write_bytes(url, b"hello world")
    assert written.size == 11
    assert written.checksum == checksum_bytes(b"hello world")
    assert s.read_bytes(url) == b"hello world"
    assert s.read_bytes(url, 6, 11) == b"world"
    assert s.exists(url) and s.isfile(url) and not s.isdir(url)
    assert s.isdir(join(root.url, "a")) and not s.isfile(join(root.url, "a"))
    assert s.size(url) == 11
    assert not s.exists(join(root.url, "missing"))
    with pytest.raises(FileNotFoundError):
        s.read_bytes(join(root.url, "missing"))


def test_streaming_write_hashes_what_it_writes(root: Root) -> None:
    s = root.storage
    parts = [b"x" * 1000, bytearray(b"y" * 7), memoryview(b"z" * (3 << 20))]
    url = join(root.url, "stream.bin")
    with s.open_write(url) as w:
        for part in parts:
            w.write(part)
    data = b"".join(bytes(p) for p in parts)
    assert w.result is not None
    assert w.result.size == len(data) == s.size(url)
    assert w.result.checksum == checksum_bytes(data)
    assert s.read_bytes(url) == data


def test_failed_streaming_write_leaves_no_file(root: Root) -> None:
    s = root.storage
    url = join(root.url, "partial.bin")
    with pytest.raises(RuntimeError, match="boom"), s.open_write(url) as w:
        w.write(b"abc")
        raise RuntimeError("boom")
    assert not s.exists(url)


def test_listdir_and_walk(root: Root) -> None:
    s = root.storage
    s.write_bytes(join(root.url, "f1"), b"1")
    s.write_bytes(join(root.url, "d", "f2"), b"22")
    s.write_bytes(join(root.url, "d", "e", "f3"), b"333")
    entries = s.listdir(root.url)
    assert [(e.name, e.is_dir) for e in entries] == [("d", True), ("f1", False)]
    assert entries[1].size == 1
    assert s.walk_files(root.url) == {"d/e/f3": 3, "d/f2": 2, "f1": 1}
    with pytest.raises(FileNotFoundError):
        s.listdir(join(root.url, "nope"))


def test_atomic_write_replaces_whole_and_leaves_no_temp(root: Root) -> None:
    s = root.storage
    url = join(root.url, "accelkit.json")
    s.write_bytes(url, b"old", atomic=True)
    written = s.write_bytes(url, b"new contents", atomic=True)
    assert s.read_bytes(url) == b"new contents"
    assert written.checksum == checksum_bytes(b"new contents")
    assert s.walk_files(root.url) == {"accelkit.json": 12}


def test_remove_and_rmtree(root: Root) -> None:
    s = root.storage
    s.write_bytes(join(root.url, "keep", "x"), b"x")
    s.write_bytes(join(root.url, "gone", "sub", "y"), b"y")
    s.write_bytes(join(root.url, "gone", "z"), b"z")
    s.remove(join(root.url, "keep", "x"))
    s.remove(join(root.url, "keep", "x"))  # missing is fine
    assert not s.exists(join(root.url, "keep", "x"))
    s.rmtree(join(root.url, "gone"))
    s.rmtree(join(root.url, "gone"))  # missing is fine
    names = [e.name for e in s.listdir(root.url)] if s.exists(root.url) else []
    assert "gone" not in names
    assert not s.exists(join(root.url, "gone", "z"))


def test_makedirs_is_idempotent(root: Root) -> None:
    s = root.storage
    s.makedirs(join(root.url, "m", "n"))
    s.makedirs(join(root.url, "m", "n"))
    s.write_bytes(join(root.url, "m", "n", "f"), b"f")
    assert s.walk_files(join(root.url, "m")) == {"n/f": 1}


def test_get_storage_protocols_and_errors(tmp_path: object) -> None:
    assert protocol_of("/x/y") == "file"
    assert protocol_of("s3://b/k") == "s3"
    assert get_storage("/tmp/a") is get_storage("relative/b")
    assert get_storage("memory://x").protocol == "memory"
    with pytest.raises(ValueError, match="nosuchproto"):
        get_storage("nosuchproto://x")
    assert (
        join("s3://b/run", "checkpoints", "checkpoint_3") == "s3://b/run/checkpoints/checkpoint_3"
    )


def test_local_symlink_is_refused_and_rmtree_keeps_target(tmp_path: os.PathLike[str]) -> None:
    s = get_storage(str(tmp_path))
    target = os.path.join(tmp_path, "secret.txt")
    with open(target, "w") as f:
        f.write("do not read")
    folder = os.path.join(tmp_path, "ckpt")
    os.makedirs(folder)
    os.symlink(target, os.path.join(folder, "model.safetensors"))
    with pytest.raises(PermissionError, match="symbolic link"):
        s.read_bytes(os.path.join(folder, "model.safetensors"))
    link_dir = os.path.join(tmp_path, "linkdir")
    os.symlink(folder, link_dir)
    s.rmtree(link_dir)
    assert os.path.exists(os.path.join(folder, "model.safetensors"))
    s.rmtree(folder)
    assert os.path.exists(target)


def test_sync_batch_defers_fsync_and_waits_for_it(root: Root) -> None:
    s = root.storage
    with sync_batch():
        written = [s.write_bytes(join(root.url, f"f{i}"), bytes([i]) * 1000) for i in range(5)]
        s.write_bytes(join(root.url, "m.json"), b"{}", atomic=True)  # synced at once
    assert [w.size for w in written] == [1000] * 5
    assert all(s.read_bytes(join(root.url, f"f{i}")) == bytes([i]) * 1000 for i in range(5))
    with pytest.raises(KeyError, match="inner"), sync_batch():
        s.write_bytes(join(root.url, "g"), b"x")
        raise KeyError("inner")  # the block's own error is not masked
