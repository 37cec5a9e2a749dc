"""Storage: accelkit's backends pass the shipped contract (:class:`accelkit.testing.
StorageContract`) on a local disk, ``memory://`` and a real S3 server, also seen through a
:class:`~accelkit.checkpointing.storage.confined.ConfinedStorage`; then what is backend-specific."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from accelkit.checkpointing.storage import (
    LocalStorage,
    Storage,
    get_storage,
    join,
    protocol_of,
    register_storage,
    sync_batch,
)
from accelkit.checkpointing.storage.confined import ConfinedStorage, confine
from accelkit.checkpointing.storage.fsspec import FsspecStorage, S3Storage
from accelkit.testing import StorageContract
from tests.checkpointing.conftest import Root
from tests.fixtures.s3 import S3Server


def _memory_url() -> str:
    return f"memory://accelkit-tests/{uuid.uuid4().hex[:12]}"


class TestLocalStorage(StorageContract):
    @pytest.fixture
    def storage_root(self, tmp_path: Path) -> tuple[Storage, str]:
        return get_storage(str(tmp_path / "root")), str(tmp_path / "root")


class TestMemoryStorage(StorageContract):
    @pytest.fixture
    def storage_root(self) -> tuple[Storage, str]:
        url = _memory_url()
        return get_storage(url), url


class TestS3Storage(StorageContract):
    @pytest.fixture
    def storage_root(self, s3_server: S3Server) -> tuple[Storage, str]:
        return get_storage(s3_server.url(), s3_server.storage_options), s3_server.new_prefix()


class TestConfinedLocalStorage(StorageContract):
    @pytest.fixture
    def storage_root(self, tmp_path: Path) -> tuple[Storage, str]:
        return confine(get_storage(str(tmp_path)), str(tmp_path)), str(tmp_path / "root")


class TestConfinedMemoryStorage(StorageContract):
    @pytest.fixture
    def storage_root(self) -> tuple[Storage, str]:
        url = _memory_url()
        return confine(get_storage(url), url), join(url, "root")


class TestConfinedS3Storage(StorageContract):
    @pytest.fixture
    def storage_root(self, s3_server: S3Server) -> tuple[Storage, str]:
        url = s3_server.new_prefix()
        return confine(get_storage(url, s3_server.storage_options), url), join(url, "root")


def test_get_storage_picks_the_class_of_the_protocol(tmp_path: Path, s3_server: S3Server) -> None:
    assert type(get_storage(str(tmp_path))) is LocalStorage
    assert get_storage("file:///x") is get_storage("local:///y") is get_storage("rel/z")
    assert type(get_storage("memory://x")) is FsspecStorage
    assert type(get_storage(s3_server.url(), s3_server.storage_options)) is S3Storage
    view = confine(get_storage(str(tmp_path)), str(tmp_path))
    assert isinstance(view, ConfinedStorage) and isinstance(view, Storage)


def test_register_storage_serves_a_protocol_and_refuses_a_duplicate(tmp_path: Path) -> None:
    class Recording(LocalStorage):
        protocol = "recordingfile"

    def factory(protocol: str, options: Any) -> Storage:
        assert (protocol, dict(options)) == ("recordingfile", {"flag": 1})
        return Recording()

    register_storage("recordingfile", factory)
    try:
        storage = get_storage(f"recordingfile://{tmp_path}/x", {"flag": 1})
        assert type(storage) is Recording
        with pytest.raises(ValueError, match=r"'recordingfile' is already served.*overwrite"):
            register_storage("recordingfile", factory)
        register_storage("recordingfile", factory, overwrite=True)
        assert get_storage(f"recordingfile://{tmp_path}/x", {"flag": 1}) is not storage
    finally:
        from accelkit.checkpointing import storage as storage_module

        storage_module._FACTORIES.pop("recordingfile", None)


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


def test_s3_create_exclusive_reads_the_servers_412_from_the_error_code_not_its_text() -> None:
    from botocore.exceptions import ClientError

    from accelkit.checkpointing.storage.fsspec import _precondition_failed

    def translated(code: str, status: int, message: str) -> OSError:
        # What s3fs raises for a ClientError it has no class for: an OSError caused by it.
        cause = ClientError(
            {
                "Error": {"Code": code, "Message": message},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "PutObject",
        )
        error = OSError(22, message)
        error.__cause__ = cause
        return error

    assert _precondition_failed(translated("PreconditionFailed", 412, "At least one failed"))
    assert _precondition_failed(translated("", 412, "no words at all"))
    # A message that merely mentions a condition is another failure, raised as it is.
    assert not _precondition_failed(translated("AccessDenied", 403, "condition: no access"))
    assert not _precondition_failed(OSError("the precondition text alone"))
