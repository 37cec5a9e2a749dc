"""S3 transfers against a real SeaweedFS (:mod:`accelkit.checkpointing.storage._s3io`).

A file is a multipart upload whose parts go out concurrently from memory: a part whose
connection is cut is re-sent on its own (no spool file, no restart of the file), a file that
cannot be finished leaves neither an object nor a pending upload behind. A read is a set of
ranged GETs into the caller's buffer: a cut request is fetched again, an object replaced in the
middle of a read fails instead of mixing two versions, and a damaged object of a checkpoint
still fails its checksum on load.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage import (
    StorageError,
    StorageNotFoundError,
    _s3io,
    get_storage,
    join,
    sync_batch,
)
from accelkit.checkpointing.storage.checksum import checksum_bytes
from accelkit.checkpointing.storage.fsspec import S3Storage
from accelkit.checkpointing.storage.retry import (
    HARD,
    RetryingStorage,
    RetryPolicy,
    classify,
    error_code,
    hard_error_fix,
)
from tests.fixtures.s3 import S3Server
from tests.helpers.faultproxy import FaultProxy

MIB = 1024 * 1024


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Parts of 5 MiB (S3's smallest), so a few MiB make a multipart upload; reads of 10 MiB
    or more go straight into the caller's buffer, smaller ones through a 5 MiB window."""
    monkeypatch.setattr(_s3io, "PART_SIZE", 5 * MIB)
    monkeypatch.setattr(_s3io, "_DIRECT", 10 * MIB)
    monkeypatch.setattr(_s3io, "_WINDOW", 5 * MIB)
    return 5 * MIB


@pytest.fixture
def no_spool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spool file for an upload is a failure: parts are retried from memory."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an S3 upload was spooled to a temporary file")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)


def _proxied(server: S3Server, proxy: FaultProxy) -> dict[str, Any]:
    return {
        **server.storage_options,
        "endpoint_url": proxy.endpoint_url,
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
    }


def _retrying(options: dict[str, Any], url: str, deadline: float = 30.0) -> RetryingStorage:
    inner = get_storage(url, options)
    assert isinstance(inner, S3Storage)
    return RetryingStorage(inner, RetryPolicy(base_delay=0.05, max_delay=0.5, deadline=deadline))


def _pending_uploads(server: S3Server, key_prefix: str) -> list[Any]:
    fs = get_storage(server.url(), server.storage_options).fs  # type: ignore[attr-defined]
    answer = fs.call_s3("list_multipart_uploads", Bucket=server.bucket, Prefix=key_prefix)
    return list(answer.get("Uploads") or [])


def test_a_file_is_a_multipart_upload_read_back_whole(
    s3_server: S3Server, small_parts: int, no_spool: None
) -> None:
    storage = _retrying(s3_server.storage_options, s3_server.url())
    url = join(s3_server.new_prefix(), "model.safetensors")
    data = os.urandom(3 * small_parts + 12_345)
    with sync_batch(), storage.open_write(url) as writer:  # completion deferred to the batch
        for start in range(0, len(data), 3 * MIB + 7):  # writes that straddle the parts
            writer.write(memoryview(data)[start : start + 3 * MIB + 7])
    assert writer.result is not None
    assert writer.result.size == len(data)
    assert writer.result.checksum == checksum_bytes(data)
    fs = storage.inner.fs  # type: ignore[attr-defined]
    etag = str(fs.info(url, refresh=True)["ETag"]).strip('"')
    assert etag.endswith("-4"), f"not a 4-part upload: ETag {etag}"
    # Read back with a small read (a window), then one large readinto (what the window holds,
    # then ranges at once straight into the buffer).
    with storage.open_read(url) as f:
        head = f.read(8)
        rest = bytearray(len(data) - 8)
        assert f.readinto(memoryview(rest)) == len(rest)
        assert f.read(1) == b""
    assert head + bytes(rest) == data
    # A file smaller than one part is a single PUT.
    small = join(s3_server.new_prefix(), "small.json")
    storage.write_bytes(small, b'{"a": 1}')
    assert storage.read_bytes(small) == b'{"a": 1}'
    assert "-" not in str(fs.info(small, refresh=True)["ETag"])


@pytest.mark.slow
def test_a_part_cut_mid_body_is_resent_alone(
    s3_server: S3Server, small_parts: int, no_spool: None
) -> None:
    with FaultProxy(("127.0.0.1", s3_server.port), seed=5) as proxy:
        storage = _retrying(_proxied(s3_server, proxy), s3_server.url())
        url = join(s3_server.new_prefix(), "optimizer.safetensors")
        data = os.urandom(4 * small_parts + 999)
        # the next 2 connections are cut after 1 MiB went upstream: parts die mid-body
        proxy.reset_after_bytes, proxy.reset_next = 1 * MIB, 2
        proxy.cut_all()
        written = storage.write_bytes(url, data)
        proxy.reset_after_bytes = None
        assert proxy.cut > 0, "no part was cut: the test proved nothing"
        assert written.checksum == checksum_bytes(data)
        clean = get_storage(s3_server.url(), s3_server.storage_options)
        assert clean.read_bytes(url) == data
        assert _pending_uploads(s3_server, url.split("/", 3)[3]) == []


def test_an_upload_that_cannot_finish_leaves_nothing(
    s3_server: S3Server, small_parts: int, no_spool: None
) -> None:
    # The block fails after two parts went out: the upload is aborted, nothing is left.
    storage = _retrying(s3_server.storage_options, s3_server.url())
    url = join(s3_server.new_prefix(), "model.safetensors")
    key = url.split("/", 3)[3]
    with pytest.raises(RuntimeError, match="boom"), storage.open_write(url) as writer:
        writer.write(os.urandom(2 * small_parts + 1))
        assert len(_pending_uploads(s3_server, key)) == 1
        raise RuntimeError("boom")
    assert not storage.exists(url)
    assert _pending_uploads(s3_server, key) == []


@pytest.mark.slow
def test_an_upload_past_its_retry_deadline_fails_with_no_object(
    s3_server: S3Server, small_parts: int, no_spool: None
) -> None:
    url = join(s3_server.new_prefix(), "model.safetensors")
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        storage = _retrying(_proxied(s3_server, proxy), s3_server.url(), deadline=1.0)
        with pytest.raises(OSError), storage.open_write(url) as writer:
            writer.write(os.urandom(2 * small_parts))  # two parts sent
            proxy.down_for(60)
            writer.write(os.urandom(2 * small_parts))
        proxy.up()
    assert not get_storage(s3_server.url(), s3_server.storage_options).exists(url)


@pytest.mark.slow
def test_a_cut_read_is_fetched_again(s3_server: S3Server, small_parts: int) -> None:
    url = join(s3_server.new_prefix(), "model.safetensors")
    data = os.urandom(3 * small_parts)
    get_storage(url, s3_server.storage_options).write_bytes(url, data)
    with FaultProxy(("127.0.0.1", s3_server.port), seed=1) as proxy:
        storage = _retrying(_proxied(s3_server, proxy), url)
        with storage.open_read(url) as f:
            proxy.reset_after_bytes, proxy.reset_next = 64, 3  # the requests themselves cut
            proxy.cut_all()
            out = bytearray(len(data))
            assert f.readinto(memoryview(out)) == len(data)
        assert proxy.cut > 0, "no request was cut: the test proved nothing"
        assert bytes(out) == data


def test_an_object_replaced_during_a_read_fails_the_read(
    s3_server: S3Server, small_parts: int
) -> None:
    url = join(s3_server.new_prefix(), "model.safetensors")
    storage = get_storage(url, s3_server.storage_options)
    storage.write_bytes(url, os.urandom(2 * small_parts))
    with storage.open_read(url) as f:
        f.read(8)
        storage.write_bytes(url, os.urandom(2 * small_parts))  # same size, new contents
        with pytest.raises(StorageError):
            f.readinto(memoryview(bytearray(2 * small_parts - 8)))


def test_a_damaged_object_fails_its_checksum_on_load(s3_server: S3Server) -> None:
    project = s3_server.new_prefix()
    config = ProjectConfiguration(project_dir=project, storage_options=s3_server.storage_options)
    accelerator = Accelerator(project_config=config, cpu=True)
    model = accelerator.prepare(nn.Linear(512, 512))
    path = accelerator.save_state(join(project, "ckpt"))
    fs = get_storage(project, s3_server.storage_options).fs  # type: ignore[attr-defined]
    target = join(path, "model.safetensors")
    raw = bytearray(fs.cat_file(target))
    raw[-3] ^= 0xFF  # one flipped bit pattern in the last tensor, same size
    fs.pipe_file(target, bytes(raw))
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        accelerator.load_state(path)


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 2])
def test_parts_in_flight_bounds_an_uploads_memory(
    s3_server: S3Server, small_parts: int, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """The replicator's budget: inside parts_in_flight(limit) an upload never has more than
    ``limit`` parts waiting for the server (counted as the pool runs them), and the file
    arrives whole."""
    import threading

    running, peak = 0, 0
    lock = threading.Lock()
    send = _s3io.MultipartSink._upload_part

    def counted(self: Any, number: int, body: bytearray) -> Any:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            return send(self, number, body)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(_s3io.MultipartSink, "_upload_part", counted)
    storage = _retrying(s3_server.storage_options, s3_server.url())
    data = os.urandom(6 * small_parts + 1)

    def upload() -> str:
        url = join(s3_server.new_prefix(), "model.safetensors")
        with storage.open_write(url) as writer:
            for start in range(0, len(data), small_parts):
                writer.write(memoryview(data)[start : start + small_parts])
        return url

    with _s3io.parts_in_flight(limit):
        url = upload()
    assert peak <= limit
    assert storage.read_bytes(url) == data
    with pytest.raises(ValueError, match="at least 1"), _s3io.parts_in_flight(0):
        pass


def test_s3_failures_leave_the_storage_as_storage_errors_of_their_kind(
    s3_server: S3Server,
) -> None:
    """What s3fs and botocore raise is a StorageError at the storage's boundary, chained from
    the backend's error: still the OSError kind a caller catches, still read by the retry
    classifier through the chain."""
    prefix = s3_server.new_prefix()
    storage = get_storage(prefix, s3_server.storage_options)
    missing = join(prefix, "missing.safetensors")
    for call in (lambda: storage.open_read(missing), lambda: storage.size(missing)):
        with pytest.raises(StorageNotFoundError, match=r"missing\.safetensors") as found:
            call()
        assert isinstance(found.value, FileNotFoundError)
        assert found.value.__cause__ is not None
        assert not isinstance(found.value.__cause__, StorageError)

    options = {**s3_server.storage_options, "secret": "not-the-secret", "skip_instance_cache": True}
    wrong = get_storage(prefix, options)

    def stream() -> None:
        with wrong.open_write(join(prefix, "model.safetensors")) as writer:
            writer.write(b"x")

    for call in (
        lambda: wrong.write_bytes(join(prefix, "a.json"), b"{}", atomic=True),
        lambda: wrong.listdir(prefix),
        stream,
        lambda: wrong.read_bytes(join(prefix, "a.json")),
    ):
        with pytest.raises(StorageError) as refused:
            call()
        assert isinstance(refused.value, OSError) and not isinstance(refused.value, ValueError)
        assert classify(refused.value) == HARD, refused.value
        assert error_code(refused.value) in ("SignatureDoesNotMatch", "403"), refused.value
        assert hard_error_fix(refused.value).startswith(("the secret key", "access denied"))
