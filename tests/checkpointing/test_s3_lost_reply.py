"""An S3 request that the server handled but whose reply never came back (the connection was
cut after the server answered), against a real SeaweedFS behind a proxy that loses the reply.

The one request for which retrying is not harmless is the completion of a multipart upload: a
second ``CompleteMultipartUpload`` finds no upload (``NoSuchUpload``), because the first one
made the object. The upload then counts as done only if the object under the key is the one
these parts make (its multipart ETag), never on the key's mere existence.
"""

from __future__ import annotations

import os

import pytest

from accelkit.checkpointing.storage import _s3io, get_storage, join
from accelkit.checkpointing.storage.checksum import checksum_bytes
from tests.checkpointing.test_storage_s3 import _pending_uploads, _proxied, _retrying
from tests.fixtures.s3 import S3Server
from tests.helpers.faultproxy import FaultProxy

MIB = 1024 * 1024


@pytest.fixture
def part_size(monkeypatch: pytest.MonkeyPatch) -> int:
    """Parts of 5 MiB (S3's smallest), so a few MiB make a multipart upload."""
    monkeypatch.setattr(_s3io, "PART_SIZE", 5 * MIB)
    return 5 * MIB


@pytest.mark.slow
def test_a_completion_whose_reply_was_lost_still_commits_the_file(
    s3_server: S3Server, part_size: int
) -> None:
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        storage = _retrying(_proxied(s3_server, proxy), s3_server.url())
        url = join(s3_server.new_prefix(), "model.safetensors")
        data = os.urandom(2 * part_size + 4321)
        proxy.lose_reply_to, proxy.lose_replies = b"<CompleteMultipartUpload", 1
        with storage.open_write(url) as writer:
            writer.write(memoryview(data))
        written = writer.result
        assert proxy.lost == 1, "no completion reply was lost: the test proved nothing"
        assert written is not None
        assert written.size == len(data)
        assert written.checksum == checksum_bytes(data)
    clean = get_storage(s3_server.url(), s3_server.storage_options)
    assert clean.read_bytes(url) == data
    assert _pending_uploads(s3_server, url.split("/", 3)[3]) == []


_NO_SUCH_UPLOAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code><Message>The '
    b"specified multipart upload does not exist. The upload ID may be invalid, or the upload "
    b"may have been aborted or completed.</Message></Error>"
)
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please '
    b"reduce your request rate.</Message></Error>"
)


def _response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )  # fmt: skip


# What MinIO answers a completion of an upload that no longer exists (one it completed already).
NO_SUCH_UPLOAD = _response(b"404 Not Found", _NO_SUCH_UPLOAD)
# A refusal to be retried, from a server that did nothing.
SLOW_DOWN = _response(b"503 Slow Down", _SLOW_DOWN)


@pytest.mark.slow
def test_a_lost_completion_answered_no_such_upload_on_retry_commits_our_object(
    s3_server: S3Server, part_size: int
) -> None:
    """MinIO answers a second completion of the same upload with NoSuchUpload (AWS and
    SeaweedFS answer it as the first): the first one made the object, and the file counts as
    written because the object's ETag is the one our parts make."""
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        storage = _retrying(_proxied(s3_server, proxy), s3_server.url())
        url = join(s3_server.new_prefix(), "optimizer.safetensors")
        data = os.urandom(2 * part_size + 99)
        proxy.lose_reply_to, proxy.lose_replies = b"<CompleteMultipartUpload", 1
        # Every later try of it, the HTTP client's own included, meets NoSuchUpload.
        proxy.answers = [NO_SUCH_UPLOAD] * 20
        with storage.open_write(url) as writer:
            writer.write(memoryview(data))
        assert proxy.lost == 1 and proxy.answered >= 1, "the retry did not meet NoSuchUpload"
        assert writer.result is not None and writer.result.checksum == checksum_bytes(data)
    clean = get_storage(s3_server.url(), s3_server.storage_options)
    assert clean.read_bytes(url) == data


@pytest.mark.slow
def test_no_such_upload_without_our_object_fails_the_file(
    s3_server: S3Server, part_size: int
) -> None:
    """A retried completion refused with NoSuchUpload when no completion of ours went through
    (an older object of another content sits at the key): the older object is not taken for
    ours, the file fails."""
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        # The default deadline (30 s): on a loaded machine one attempt can take seconds (in a CI
        # run the first completion took 5.8 s and ended in a closed connection), and a 5 s
        # deadline gave up before the retry that meets NoSuchUpload.
        storage = _retrying(_proxied(s3_server, proxy), s3_server.url())
        url = join(s3_server.new_prefix(), "model.safetensors")
        old = os.urandom(2 * part_size + 5)
        with storage.open_write(url) as writer:
            writer.write(memoryview(old))
        # The first completion never reaches the server (refused with SlowDown, which is
        # retried) and the retry is answered NoSuchUpload: the object at the key is still the
        # old one, whose ETag is not ours.
        proxy.lose_reply_to = b"<CompleteMultipartUpload"
        proxy.answers = [SLOW_DOWN] + [NO_SUCH_UPLOAD] * 20
        writer = storage.open_write(url)
        writer.write(memoryview(os.urandom(2 * part_size + 5)))
        with pytest.raises(OSError, match="specified multipart upload does not exist"):
            writer.close()
        assert proxy.answered >= 2, "the completion was not retried into NoSuchUpload"
    # A failed file leaves nothing at its path (as any failed upload): not the older object.
    assert not get_storage(s3_server.url(), s3_server.storage_options).exists(url)
