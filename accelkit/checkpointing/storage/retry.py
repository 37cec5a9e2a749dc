"""Retries for transient storage errors: a policy, a classifier, and a storage that retries.

An object store is somebody else's network service: connections are refused or reset, requests
time out, servers answer 5xx or ask the client to slow down (``SlowDown``, 429). Those errors
are *transient*: the same request succeeds later. Others are *hard*: wrong credentials, a
missing bucket, a denied permission; retrying them only hides the fix, so they are raised at
once, and :func:`hard_error_fix` says what to change.

- :class:`RetryPolicy` -- exponential backoff with jitter, bounded by a total time per
  operation (``None``: keep trying; a caller that may stop passes ``should_stop``).
- :func:`classify` -- ``"transient"``, ``"hard"`` or ``None`` (neither: let it rise as it is).
  It reads exception classes and the status/code of a botocore ``ClientError`` found on the
  chain (``__cause__``/``__context__``), never message text.
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
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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
from accelkit.errors import ConfigurationError

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

TRANSIENT = "transient"
HARD = "hard"

T = TypeVar("T")

# Exception classes (by name, from botocore, aiohttp, urllib3, s3fs) that mean "the network or
# the server failed this time". Names, not imports: none of these packages is a dependency.
_TRANSIENT_CLASSES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "ProtocolError",
        "ProxyConnectionError",
        "HTTPClientError",
    }
)
_HARD_CLASSES = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "InternalServerError",
        "BadGateway",
        "GatewayTimeout",
    }
)
_HARD_CODES = {
    "InvalidAccessKeyId": "the access key is not known to the server",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "ExpiredToken": "the session token has expired",
    "InvalidToken": "the session token is not valid",
    "AccessDenied": "the credentials may not do this",
    "AllAccessDisabled": "access to the bucket is disabled",
    "NoSuchBucket": "the bucket does not exist",
    "InvalidBucketName": "the bucket name is not valid",
    "AccountProblem": "the account has a problem",
}
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
_MAX_CHAIN = 8


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < _MAX_CHAIN:
        error = todo.pop(0)
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        for nxt in (error.__cause__, error.__context__):
            if nxt is not None:
                todo.append(nxt)


def _response(error: BaseException) -> tuple[str, int | None] | None:
    response = getattr(error, "response", None)  # botocore's ClientError.response
    if not isinstance(response, Mapping):
        return None
    code = str((response.get("Error") or {}).get("Code", ""))
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code, status if isinstance(status, int) else None


def error_code(exc: BaseException) -> str:
    """The first S3 error code (``"NoSuchUpload"``, ...) in ``exc``'s chain of causes, ``""`` if
    none (s3fs re-raises botocore's errors as ``OSError``)."""
    for error in _chain(exc):
        answer = _response(error)
        if answer is not None and answer[0]:
            return answer[0]
    return ""


def _one(error: BaseException) -> str | None:
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _HARD_CLASSES:
        return HARD
    answer = _response(error)
    if answer is not None:
        code, status = answer
        if code in _HARD_CODES or status in (401, 403):
            return HARD
        if code in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500):
            return TRANSIENT
        if code.isdigit() and (int(code) >= 500 or int(code) == 429):
            return TRANSIENT
    if names & _TRANSIENT_CLASSES:
        return TRANSIENT
    if isinstance(error, (ConnectionError, TimeoutError)):
        return TRANSIENT
    return None


def classify(exc: BaseException) -> str | None:
    """Whether ``exc`` is :data:`TRANSIENT` (retry it), :data:`HARD` (never retry; see
    :func:`hard_error_fix`) or ``None`` (neither: a missing file, a bug; let it rise).

    The whole chain of causes is read: s3fs re-raises botocore's errors as ``OSError``; a hard
    cause anywhere wins over a transient one.
    """
    found: str | None = None
    for error in _chain(exc):
        kind = _one(error)
        if kind == HARD:
            return HARD
        found = found or kind
    return found


def hard_error_fix(exc: BaseException) -> str:
    """What is wrong and how to fix it, for an error :func:`classify` calls hard."""
    for error in _chain(exc):
        answer = _response(error)
        code = answer[0] if answer else ""
        names = {cls.__name__ for cls in type(error).__mro__}
        if code in ("NoSuchBucket", "InvalidBucketName"):
            return f"{_HARD_CODES[code]}: {_FIXES['bucket']}"
        if code in ("AccessDenied", "AllAccessDisabled", "AccountProblem") or (
            answer and answer[1] == 403 and code not in _HARD_CODES
        ):
            return f"{_HARD_CODES.get(code, 'access denied')}: {_FIXES['permission']}"
        if code in _HARD_CODES or names & _HARD_CLASSES or (answer and answer[1] == 401):
            what = _HARD_CODES.get(code, "no valid credentials")
            return f"{what}: {_FIXES['credentials']}"
    return f"{_FIXES['credentials']}; {_FIXES['permission']}"


@dataclass(frozen=True)
class RetryPolicy:
    """How transient storage errors are retried: exponential backoff with jitter.

    The n-th wait is ``min(max_delay, base_delay * multiplier**n)``, scaled by a random factor
    in ``[1 - jitter, 1]`` (so many clients do not retry in step).

    Args:
        base_delay: the first wait, in seconds.
        max_delay: the longest wait.
        multiplier: growth of the wait per attempt.
        jitter: fraction of each wait that is random (0: none; 1: "full jitter").
        deadline: give up on one operation after this many seconds of retrying (``None``:
            keep trying; the replicator stops when asked to).

    Raises:
        ConfigurationError: a negative delay, a multiplier below 1, a jitter outside ``[0, 1]``
            (a ``ValueError``).
    """

    base_delay: float = 0.25
    max_delay: float = 15.0
    multiplier: float = 2.0
    jitter: float = 0.5
    deadline: float | None = 120.0

    def __post_init__(self) -> None:
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ConfigurationError(
                f"RetryPolicy needs 0 <= base_delay <= max_delay, got base_delay="
                f"{self.base_delay!r}, max_delay={self.max_delay!r}."
            )
        if self.multiplier < 1:
            raise ConfigurationError(
                f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}."
            )
        if not 0 <= self.jitter <= 1:
            raise ConfigurationError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter!r}.")
        if self.deadline is not None and self.deadline < 0:
            raise ConfigurationError(
                f"RetryPolicy.deadline must be >= 0 seconds or None, got {self.deadline!r}."
            )

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after failed attempt number ``attempt`` (0-based)."""
        raw = min(self.max_delay, self.base_delay * self.multiplier ** min(attempt, 64))
        spread = (rng or random).random() * self.jitter
        return raw * (1.0 - spread)


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    should_stop: Callable[[], bool] | None = None,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, retrying :data:`TRANSIENT` errors under ``policy``.

    A hard error, an error that is neither, or a transient one past the policy's deadline (or
    once ``should_stop()`` is true) is raised as it is; the last transient one carries a note
    saying how long it was retried.

    Args:
        fn: the operation (called again from the start on each attempt).
        policy: the backoff.
        what: names the operation in log lines (``"upload of s3://b/run/x"``).
        should_stop: checked before each wait: true ends the retries.
        on_retry: ``on_retry(error, attempt, wait)`` before each wait (default: a debug line).
        sleep: how to wait (an ``Event.wait`` makes waits interruptible).
    """
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if classify(exc) != TRANSIENT:
                raise
            elapsed = time.monotonic() - started
            wait = policy.delay(attempt)
            over = policy.deadline is not None and elapsed + wait > policy.deadline
            if over or (should_stop is not None and should_stop()):
                note = getattr(exc, "add_note", None)  # Python >= 3.11
                if note is not None:
                    note(
                        f"accelkit retried {what} for {elapsed:.1f} s ({attempt + 1} attempts) "
                        "before giving up."
                    )
                raise
            if on_retry is not None:
                on_retry(exc, attempt, wait)
            else:
                logger.debug("%s failed (%s); retrying in %.2f s", what, exc, wait)
            sleep(wait)
            attempt += 1


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
