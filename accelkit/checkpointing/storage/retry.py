"""Retries for transient storage errors: a storage that retries, and the fix of a hard error.

An object store is somebody else's network service: connections are refused or reset, requests
time out, servers answer 5xx or ask the client to slow down (``SlowDown``, 429). Those errors
are *transient*: the same request succeeds later. Others are *hard*: wrong credentials, a
missing bucket, a denied permission; retrying them only hides the fix, so they are raised at
once, and :func:`hard_error_fix` says what to change.

The policy, the classifier and the retried call are the delivery room's, shared with
replication and the trackers (:mod:`accelkit.delivery`), and named here too:

- :class:`RetryPolicy` -- exponential backoff with jitter, bounded by a total time per
  operation (``None``: keep trying; a caller that may stop passes ``should_stop``).
- :func:`classify` -- ``"transient"``, ``"hard"`` or ``None`` for a storage (neither: let it
  rise as it is; a ``ValueError`` is a bug here, not a refused value). It reads exception
  classes and the status/code of a botocore ``ClientError`` found on the chain
  (``__cause__``/``__context__``), never message text.
- :func:`retry_call` -- call a function under a policy.
- :class:`RetryingStorage` -- a storage whose every primitive is retried per call. A file
  written through it is retried request by request where the backend can
  (:meth:`~accelkit.checkpointing.storage.base.Storage.open_sink_retrying`: S3 re-sends one
  part from memory); elsewhere it is spooled to a local temporary file and uploaded whole
  under the policy (one file retried, never the whole checkpoint, memory bounded by one
  chunk). What ``ProjectConfiguration(project_dir="s3://...")`` saves go through.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable
from typing import IO, BinaryIO, Protocol, TypeVar, cast

from typing_extensions import override

from accelkit.checkpointing.storage.base import (
    Entry,
    HashingWriter,
    Sink,
    Storage,
    StorageError,
    WrappedStorage,
    WrittenFile,
)
from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM, checksum_bytes
from accelkit.delivery.failures import (
    HARD,
    HARD_CODES,
    TRANSIENT,
    causes,
    classify,
    error_code,
    service_answer,
)
from accelkit.delivery.retry import RetryPolicy, retry_call

__all__ = [
    "HARD",
    "TRANSIENT",
    "Readable",
    "RetryPolicy",
    "RetryingStorage",
    "classify",
    "copy_stream",
    "error_code",
    "hard_error_fix",
    "retry_call",
    "with_retries",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FIXES = {
    "credentials": (
        "check the key and secret in ProjectConfiguration(storage_options={'key': ..., "
        "'secret': ...}) or the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables"
    ),
    "bucket": "create the bucket, or correct the bucket name in the URL",
    "permission": (
        "grant these credentials read, write, list and delete on the bucket (s3:GetObject, "
        "s3:PutObject, s3:ListBucket, s3:DeleteObject)"
    ),
}


def hard_error_fix(exc: BaseException) -> str:
    """What is wrong and how to fix it, for an error :func:`classify` calls hard."""
    for error in causes(exc):
        answer = service_answer(error)
        code = answer[0] if answer else ""
        if code in ("NoSuchBucket", "InvalidBucketName"):
            return f"{HARD_CODES[code]}: {_FIXES['bucket']}"
        if code in ("AccessDenied", "AllAccessDisabled", "AccountProblem") or (
            answer and answer[1] == 403 and code not in HARD_CODES
        ):
            return f"{HARD_CODES.get(code, 'access denied')}: {_FIXES['permission']}"
        no_credentials = answer is None and classify(error, chain=False) == HARD  # botocore's
        if code in HARD_CODES or no_credentials or (answer and answer[1] == 401):
            what = HARD_CODES.get(code, "no valid credentials")
            return f"{what}: {_FIXES['credentials']}"
    return f"{_FIXES['credentials']}; {_FIXES['permission']}"


_SPOOL_CHUNK = 16 * 1024 * 1024


class _SpooledSink:
    """A file written through :class:`RetryingStorage`: spooled to a local temporary file, then
    uploaded whole (with retries) on commit. Memory: one chunk."""

    chunk_size = _SPOOL_CHUNK

    def __init__(self, owner: RetryingStorage, url: str) -> None:
        self._owner = owner
        self._url = url
        self._spool: IO[bytes] = tempfile.TemporaryFile(prefix="accelkit-upload-")  # noqa: SIM115

    def write(self, data: memoryview) -> int:
        return self._spool.write(data)

    def commit(self, deferred: bool) -> None:
        try:
            self._owner.upload(self._url, self._spool)
        finally:
            self._spool.close()

    def abort(self) -> None:
        self._spool.close()


class Readable(Protocol):
    """What :func:`copy_stream` reads from: a file, or a verified reader."""

    def readinto(self, buffer: memoryview, /) -> int | None:
        """Fill ``buffer``; the byte count (0 at the end)."""


def copy_stream(source: Readable, sink: Sink, chunk: int = _SPOOL_CHUNK) -> int:
    """Copy ``source`` into ``sink`` in ``chunk``-sized reads (one buffer, reused); returns the
    byte count. The sink is neither committed nor aborted here."""
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    while True:
        count = source.readinto(view)
        if not count:
            return total
        done = 0
        while done < count:
            written = sink.write(view[done:count])
            if not written:
                raise StorageError(f"writing to {sink!r} made no progress")
            done += written
        total += count


class RetryingStorage(WrappedStorage):
    """A storage that retries transient errors of ``inner`` under ``policy``, per call.

    Queries, deletes and small writes are retried as they are. A streamed file
    (:meth:`open_write`) is retried request by request where ``inner`` offers it
    (:meth:`~accelkit.checkpointing.storage.base.Storage.open_sink_retrying`: an S3 upload
    re-sends a cut part from memory); otherwise it is spooled to a local temporary file and
    uploaded whole on close, so an upload cut by an outage is redone from its first byte. Either
    way it is never half-committed. Reads are retried per request where ``inner`` can
    (:meth:`~accelkit.checkpointing.storage.base.Storage.open_read_retrying`: S3's ranged
    GETs), else when opened (a read cut in the middle raises: the caller re-reads the file).

    Args:
        inner: the storage to retry (an object store).
        policy: the backoff and its deadline.
        should_stop: ends the retries early when true (e.g. the run is shutting down).
    """

    def __init__(
        self,
        inner: Storage,
        policy: RetryPolicy | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self._should_stop = should_stop

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return retry_call(fn, self.policy, what, should_stop=self._should_stop)

    def upload(self, url: str, spool: IO[bytes]) -> None:
        """Upload the whole of ``spool`` to ``url`` (retried from its start on each attempt)."""

        def once() -> None:
            spool.seek(0)
            sink = self.inner.open_sink(url)
            try:
                copy_stream(cast(Readable, spool), sink)  # a buffered file: it has readinto
            except BaseException:
                with contextlib.suppress(Exception):
                    sink.abort()
                with contextlib.suppress(Exception):
                    self.inner.remove(url)
                raise
            sink.commit(False)

        self._retry(f"upload of {url}", once)

    @override
    def exists(self, url: str) -> bool:
        return self._retry(f"exists({url})", lambda: self.inner.exists(url))

    @override
    def isdir(self, url: str) -> bool:
        return self._retry(f"isdir({url})", lambda: self.inner.isdir(url))

    @override
    def isfile(self, url: str) -> bool:
        return self._retry(f"isfile({url})", lambda: self.inner.isfile(url))

    @override
    def size(self, url: str) -> int:
        return self._retry(f"size({url})", lambda: self.inner.size(url))

    @override
    def listdir(self, url: str) -> list[Entry]:
        return self._retry(f"listdir({url})", lambda: self.inner.listdir(url))

    @override
    def open_read(self, url: str) -> BinaryIO:
        return self.inner.open_read_retrying(url, self._retry)

    @override
    def open_sink(self, url: str) -> Sink:
        return self.inner.open_sink_retrying(url, self._retry) or _SpooledSink(self, url)

    @override
    def open_write(self, url: str, algorithm: str = DEFAULT_ALGORITHM) -> HashingWriter:
        return HashingWriter(self, url, algorithm)

    @override
    def write_bytes(
        self, url: str, data: bytes | bytearray | memoryview, atomic: bool = False
    ) -> WrittenFile:
        self._retry(f"upload of {url}", lambda: self.inner.write_bytes(url, data, atomic=True))
        return WrittenFile(url, len(data), checksum_bytes(data))

    @override
    def create_exclusive(self, url: str, data: bytes) -> bool:
        return self._retry(
            f"create_exclusive({url})", lambda: self.inner.create_exclusive(url, data)
        )

    @override
    def makedirs(self, url: str) -> None:
        self._retry(f"makedirs({url})", lambda: self.inner.makedirs(url))

    @override
    def remove(self, url: str) -> None:
        self._retry(f"remove({url})", lambda: self.inner.remove(url))

    @override
    def rmtree(self, url: str) -> None:
        self._retry(f"rmtree({url})", lambda: self.inner.rmtree(url))


def with_retries(storage: Storage, seconds: float) -> Storage:
    """``storage`` wrapped in a :class:`RetryingStorage` with a ``seconds`` deadline per
    operation, if it is an object store (a local disk or fsspec's ``memory`` has no transient
    errors to retry; ``seconds == 0`` turns retries off)."""
    if seconds <= 0 or storage.is_local or storage.protocol in ("file", "local", "memory"):
        return storage
    if isinstance(storage, RetryingStorage):
        return storage
    return RetryingStorage(storage, RetryPolicy(deadline=float(seconds)))
