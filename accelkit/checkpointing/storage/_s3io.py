"""S3 transfers at the client's limit: what :class:`~accelkit.checkpointing.storage.fsspec.
S3Storage` writes and reads checkpoint files with.

- :class:`MultipartSink` -- a file streamed to S3 as a multipart upload. The bytes are copied
  into part buffers (the hash of :class:`~accelkit.checkpointing.storage.base.HashingWriter` is
  taken on the way in, on the caller's thread), or read straight into them
  (:meth:`MultipartSink.fill`, the replicator's copy), and each full part is sent, from its
  buffer and without a copy, by a pool thread while the caller fills the next one: a few
  parts in flight, bounded for the whole process by :data:`MAX_PARTS_IN_FLIGHT` (the memory
  budget: that many parts plus the one being filled).
  A part stays in memory until the server has it, so a transient failure re-sends that part
  only (no spool file, no restart of the file). A file smaller than one part is one PUT. The
  object becomes visible only when the upload completes: inside a :func:`~accelkit.
  checkpointing.storage.sync_batch` that completion is deferred to the end of the batch, so the
  next file's parts start right away.
- :class:`RangedReader` -- a file read with ranged GETs: a large ``readinto`` (32 MiB or
  more) is split into :data:`PART_SIZE` ranges fetched concurrently, each streamed straight
  into its slice of the caller's buffer (no intermediate ``bytes`` of the whole range, no
  read-ahead cache copy); smaller reads (a header, tensors of a few MiB) are served from a
  64 MiB window fetched the same way. Every range is pinned to the ETag seen when
  the file was opened, so a file replaced during the read fails instead of mixing versions.

A caller with a tighter memory budget than the process's asks for fewer parts in flight per
upload with :func:`parts_in_flight` (the replicator does: its budget is 64 MB plus one read
buffer).

Both take a ``retry`` runner (``retry(what, fn)``, from :class:`~accelkit.checkpointing.
storage.retry.RetryingStorage`) that each request is run under.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from accelkit.checkpointing.storage._localfile import defer_to_batch
from accelkit.checkpointing.storage._pools import first_failure, thread_pool
from accelkit.checkpointing.storage.base import (
    StorageConnectionError,
    StorageError,
    StorageIsADirectoryError,
    as_storage_error,
)
from accelkit.checkpointing.storage.retry import error_code
from accelkit.errors import ConfigurationError

__all__ = [
    "MAX_PARTS_IN_FLIGHT",
    "PART_SIZE",
    "MultipartSink",
    "RangedReader",
    "made_from",
    "multipart_etag",
    "no_retry",
    "parts_in_flight",
]

T = TypeVar("T")

PART_SIZE = 16 * 1024 * 1024
"""Bytes per part of an upload and per range of a read (S3 needs >= 5 MiB for every part but
the last)."""

MAX_PARTS_IN_FLIGHT = 6
"""Parts sent (or ranges fetched) at once by the whole process; uploads also bound their
memory with it."""

_MAX_PARTS = 10_000  # S3's limit per upload
_FIRST_BUFFER = 1024 * 1024  # a file's first part buffer: small files stay cheap
# Reads smaller than this are served from a window of _WINDOW bytes fetched as concurrent
# ranges (a checkpoint holds many tensors of a few MiB: one GET each would run serially).
_DIRECT = 32 * 1024 * 1024
_WINDOW = 64 * 1024 * 1024
_WORKERS = MAX_PARTS_IN_FLIGHT
_BUDGET = threading.BoundedSemaphore(MAX_PARTS_IN_FLIGHT)
_LOCAL = threading.local()  # .limit: parts_in_flight's limit in this thread


@contextlib.contextmanager
def parts_in_flight(limit: int) -> Iterator[None]:
    """Uploads begun in this thread inside the block keep at most ``limit`` of their parts in
    flight (each part :data:`PART_SIZE` bytes of memory until the server has it), within the
    process's :data:`MAX_PARTS_IN_FLIGHT`: for a caller with a tighter memory budget.

    Raises:
        ConfigurationError: ``limit`` is below 1 (a ``ValueError``).
    """
    if limit < 1:
        raise ConfigurationError(
            f"parts_in_flight needs a limit of at least 1 (parts waiting for the server), got "
            f"{limit!r}; e.g. parts_in_flight(1) for the least memory."
        )
    previous = getattr(_LOCAL, "limit", None)
    _LOCAL.limit = limit
    try:
        yield
    finally:
        _LOCAL.limit = previous


# Why a part is an ``io.BytesIO`` (measured for issue #26 with tracemalloc at the replicator's
# peak): aiohttp sends a bytes-like body as one write, which on Python 3.11 costs three
# transient copies of the part (headers and body joined into one ``bytes``; asyncio's
# transport slicing off what the socket took, then copying the rest into its own buffer):
# 41 MB of the replicator's 97 MB with 16 MiB parts. A ``BytesIO`` body is streamed in 256 KiB
# reads, each written once the socket drained the previous one: no copy of the part is made.
def _new_part(size: int) -> io.BytesIO:
    """A part buffer of ``size`` bytes (zeros), filled through ``getbuffer()`` and sent as
    the request's body itself."""
    part = io.BytesIO()
    if size:
        part.seek(size - 1)
        part.write(b"\0")  # one allocation of ``size`` (``BytesIO(bytes(size))`` makes two)
    return part


class _Buffers:
    """Part buffers (:data:`PART_SIZE` bytes) reused from part to part and file to file while
    uploads run (a fresh buffer costs its page faults each time: a fifth of a save's CPU on a
    busy machine), all dropped when the process's last upload ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[io.BytesIO] = []
        self._users = 0

    def enter(self) -> None:
        with self._lock:
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users <= 0:
                self._users = 0
                self._free.clear()

    def take(self, size: int) -> io.BytesIO:
        if size == PART_SIZE:
            with self._lock:
                if self._free:
                    return self._free.pop()
        return _new_part(size)

    def give(self, part: io.BytesIO, size: int) -> None:
        with self._lock:
            if self._users and size == PART_SIZE and len(self._free) <= MAX_PARTS_IN_FLIGHT:
                self._free.append(part)


_BUFFERS = _Buffers()
_EMPTY = io.BytesIO()  # a sink's part once sent or dropped


def _part_done(
    body: io.BytesIO, size: int, slots: threading.BoundedSemaphore | None = None
) -> None:
    _BUDGET.release()
    if slots is not None:
        slots.release()
    _BUFFERS.give(body, size)


def no_retry(what: str, fn: Callable[[], T]) -> T:
    """The runner that runs ``fn`` once."""
    return fn()


def _call(fs: Any, method: str, **kwargs: Any) -> Any:
    """``fs.call_s3(method, **kwargs)``, a failure always a :class:`~accelkit.checkpointing.
    storage.StorageError` (what s3fs or botocore raised becomes its cause: :func:`~accelkit.
    delivery.failures.classify` reads it there)."""
    try:
        return fs.call_s3(method, **kwargs)
    except StorageError:
        raise
    except Exception as exc:
        where = f"s3://{kwargs.get('Bucket')}/{kwargs.get('Key')}"
        raise as_storage_error(exc, f"S3 {method} of {where}") from exc


def multipart_etag(parts: list[dict[str, Any]]) -> str | None:
    """The ETag S3 gives the object completed from ``parts`` (``{"PartNumber", "ETag"}``, in
    order): the MD5 of the parts' binary MD5s, ``-`` and their count. ``None`` when a part's
    ETag is not an MD5 (encrypted with SSE-KMS or SSE-C): then nothing can be told from it."""
    digests = []
    for part in parts:
        tag = str(part["ETag"]).strip('"')
        if len(tag) != 32 or any(c not in "0123456789abcdefABCDEF" for c in tag):
            return None
        digests.append(bytes.fromhex(tag))
    digest = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
    return f"{digest}-{len(parts)}"


def made_from(fs: Any, bucket: str, key: str, parts: list[dict[str, Any]]) -> bool:
    """Whether the object at ``bucket/key`` is the one a completion of ``parts`` made (its ETag
    is :func:`multipart_etag`); ``False`` when there is none or it cannot be told."""
    expected = multipart_etag(parts)
    if expected is None:
        return False
    try:
        answer = _call(fs, "head_object", Bucket=bucket, Key=key)
    except OSError as error:
        if error_code(error) in ("404", "NoSuchKey", "NotFound") or isinstance(
            error, FileNotFoundError
        ):
            return False
        raise
    return str(answer.get("ETag", "")).strip('"').lower() == expected


def _pool() -> Any:
    # Detached: a request stalled on a paused server must not hold interpreter exit once the
    # uploader gave it up (the replicator's drain deadline, a preemption's budget).
    return thread_pool("s3", _WORKERS, detached=True)


def _part_size(number: int) -> int:
    """Size of part ``number`` (1-based): :data:`PART_SIZE`, growing after every 1,000 parts so
    a file of any size fits in S3's 10,000 parts."""
    return PART_SIZE * (1 + (number - 1) // 1000)


class MultipartSink:
    """A new S3 object written as parts sent concurrently; see the module docstring.

    Args:
        fs: the ``s3fs.S3FileSystem``.
        path: ``bucket/key``.
        retry: the runner each request goes through.
    """

    chunk_size = PART_SIZE

    def __init__(self, fs: Any, path: str, retry: Callable[[str, Callable[[], Any]], Any]) -> None:
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._retry = retry
        self._number = 1
        self._size = min(_FIRST_BUFFER, PART_SIZE)
        self._part: io.BytesIO = _new_part(self._size)
        self._view = self._part.getbuffer()
        self._filled = 0
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._closed = False
        self._left = False
        limit = getattr(_LOCAL, "limit", None)
        self._slots = threading.BoundedSemaphore(limit) if limit else None
        _BUFFERS.enter()

    def _leave(self) -> None:
        if not self._left:
            self._left = True
            _BUFFERS.leave()

    def _what(self, part: int | None = None) -> str:
        return f"upload of s3://{self._path}" + (f" (part {part})" if part else "")

    def _room(self, want: int) -> memoryview:
        """The free space of the current part for ``want`` more bytes: the small first buffer
        while they fit in it, else a part buffer of the part's full size."""
        size = _part_size(self._number)
        if self._size < size and self._filled + max(want, 1) > self._size:
            grown = _BUFFERS.take(size)  # grow from the small first buffer on demand
            view = grown.getbuffer()
            view[: self._filled] = self._view[: self._filled]
            self._view.release()
            self._part, self._view, self._size = grown, view, size
        return self._view[self._filled : min(size, self._size)]

    def _filled_by(self, count: int) -> None:
        self._filled += count
        if self._filled == _part_size(self._number):
            self._send_part()

    def write(self, data: memoryview) -> int:
        """Copy ``data`` into the current part; a full part is sent, the call returning once
        the process's budget of parts in flight allows it."""
        total = len(data)
        done = 0
        while done < total:
            with self._room(total - done) as room:
                count = min(len(room), total - done)
                room[:count] = data[done : done + count]
            done += count
            self._filled_by(count)
        return total

    def fill(self, readinto: Callable[[memoryview], int], expected: int) -> int:
        """Read the next bytes of the file straight into the current part: ``readinto(view)``
        fills (some of) the part's free space; no copy is made. A full part is sent as
        :meth:`write` sends it.

        Args:
            readinto: reads into the view it is given, returns the byte count (0: the end).
            expected: the bytes still to come, as far as the caller knows (a small file keeps
                to the small first buffer; a wrong guess costs a copy of it, nothing else).

        Returns:
            The byte count ``readinto`` returned (0: the source is at its end).
        """
        with self._room(expected) as room:
            count = readinto(room)
        if count:
            self._filled_by(count)
        return count

    def _send_part(self) -> None:
        if self._upload_id is None:
            answer = self._retry(
                f"start of {self._what()}",
                lambda: _call(
                    self._fs, "create_multipart_upload", Bucket=self._bucket, Key=self._key
                ),
            )
            self._upload_id = str(answer["UploadId"])
        if self._number > _MAX_PARTS:
            raise StorageError(f"{self._what()}: more than {_MAX_PARTS} parts")
        body, size = self._body(), self._size
        self._part, self._size, self._view, self._filled = _EMPTY, 0, memoryview(b""), 0
        number = self._number
        self._number += 1
        slots = self._slots
        if slots is not None:  # this upload's own budget (parts_in_flight)
            slots.acquire()
        _BUDGET.acquire()  # memory: at most MAX_PARTS_IN_FLIGHT parts wait for the server
        try:
            future = _pool().submit(self._upload_part, number, body)
        except BaseException:
            _BUDGET.release()
            if slots is not None:
                slots.release()
            raise
        # Sent, failed for good or cancelled: the part's memory is free again.
        future.add_done_callback(lambda _f: _part_done(body, size, slots))
        self._parts.append(future)
        # A part that already failed for good ends the file now, not at its commit.
        failed = next((f for f in self._parts if f.done() and f.exception() is not None), None)
        if failed is not None:
            failed.result()

    def _body(self) -> io.BytesIO:
        """The current part as a request body: its filled bytes, the buffer itself."""
        self._view.release()
        body = self._part
        if self._filled < self._size:
            body.truncate(self._filled)  # the last part (or a small file): never pooled
            self._size = 0
        return body

    def _upload_part(self, number: int, body: io.BytesIO) -> dict[str, Any]:
        def send() -> Any:
            body.seek(0)  # each try sends the part from its start
            return _call(
                self._fs,
                "upload_part",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )

        answer = self._retry(self._what(number), send)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _finish(self) -> None:
        """Complete the upload (or PUT a file smaller than one part); aborts it on failure."""
        try:
            if self._upload_id is None:
                body = self._body()

                def put() -> Any:
                    body.seek(0)  # each try sends the file from its start
                    return _call(
                        self._fs, "put_object", Bucket=self._bucket, Key=self._key, Body=body
                    )

                self._retry(self._what(), put)
            else:
                self._complete([f.result() for f in self._parts])
        except BaseException:
            self._abort_upload()
            raise
        finally:
            self._drop()
            self._fs.invalidate_cache(self._path)
            self._leave()

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        """Complete the upload from ``parts``.

        A completion the server handled but whose reply was lost (a cut connection) is sent
        again, by the retry runner or by the HTTP client itself; some servers (MinIO) answer
        the second one with ``NoSuchUpload``, the first having made the object. A
        ``NoSuchUpload`` counts as done only if the object under the key is the one these parts
        make (its multipart ETag, the MD5 of each part's MD5: the same bytes), never on the
        key's existence.
        """

        def complete() -> Any:
            try:
                return _call(
                    self._fs,
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except OSError as error:
                if error_code(error) == "NoSuchUpload" and made_from(
                    self._fs, self._bucket, self._key, parts
                ):
                    return None
                raise

        self._retry(f"completion of {self._what()}", complete)

    def commit(self, deferred: bool) -> None:
        """Send what is left and complete the upload: now, or with ``deferred`` inside a
        :func:`~accelkit.checkpointing.storage.sync_batch`, when the batch ends."""
        if self._closed:
            return
        self._closed = True
        if self._upload_id is not None and self._filled:
            # The last part goes out now: a deferred completion holds no buffer of its own.
            try:
                self._send_part()
            except BaseException:
                try:
                    self._abort_upload()
                finally:
                    self._leave()
                raise
        if not (deferred and defer_to_batch(self._finish)):
            self._finish()

    def abort(self) -> None:
        """Drop the upload: parts in flight are waited for, then the upload is aborted."""
        if self._closed:
            return
        self._closed = True
        self._drop()
        try:
            self._abort_upload()
        finally:
            self._leave()

    def _drop(self) -> None:
        self._view.release()
        self._part, self._size, self._view = _EMPTY, 0, memoryview(b"")

    def _abort_upload(self) -> None:
        for future in self._parts:
            future.cancel()
        for future in self._parts:
            with contextlib.suppress(BaseException):
                future.result()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                _call(
                    self._fs,
                    "abort_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=upload_id,
                )


async def _get_into(fs: Any, request: dict[str, Any], view: memoryview) -> int:
    """One ranged GET streamed into ``view``; returns the byte count."""
    answer = await fs._call_s3("get_object", **request)
    body = answer["Body"]
    got = 0
    try:
        while got < len(view):
            count = await body.readinto(view[got:])
            if not count:
                break
            got += count
    finally:
        body.close()
    return got


class RangedReader:
    """A binary stream over one S3 object, read with concurrent ranged GETs; see the module
    docstring.

    Args:
        fs: the ``s3fs.S3FileSystem``.
        path: ``bucket/key``.
        retry: the runner each request goes through.

    Raises:
        FileNotFoundError: there is no such object.
    """

    def __init__(self, fs: Any, path: str, retry: Callable[[str, Callable[[], Any]], Any]) -> None:
        self._fs = fs
        self.path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._retry = retry
        head = retry(f"open(s3://{path})", lambda: fs.info(path, refresh=True))
        if head.get("type") == "directory":
            raise StorageIsADirectoryError(f"s3://{path} is a folder")
        self.size = int(head["size"])
        self._etag = head.get("ETag")
        self._pos = 0
        self._ahead = memoryview(b"")
        self._ahead_at = 0
        self.closed = False

    def __enter__(self) -> RangedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the stream (nothing is held open between reads)."""
        self.closed = True
        self._ahead = memoryview(b"")

    def readable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """The read position."""
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the read position (``whence``: 0 start, 1 current, 2 end)."""
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _request(self, start: int, end: int) -> dict[str, Any]:
        request = {"Bucket": self._bucket, "Key": self._key, "Range": f"bytes={start}-{end - 1}"}
        if self._etag:
            request["IfMatch"] = self._etag
        return request

    def _fetch(self, start: int, view: memoryview) -> None:
        from fsspec.asyn import sync

        request = self._request(start, start + len(view))

        def once() -> None:
            try:
                got = sync(self._fs.loop, _get_into, self._fs, request, view)
            except StorageError:
                raise
            except Exception as exc:
                what = f"S3 read of s3://{self.path} at {start}"
                raise as_storage_error(exc, what) from exc
            if got != len(view):
                raise StorageConnectionError(
                    f"s3://{self.path}: {got} of {len(view)} bytes of a range at {start}"
                )

        self._retry(f"read of s3://{self.path} at {start}", once)

    def _fetch_many(self, start: int, view: memoryview) -> None:
        if len(view) <= PART_SIZE:
            self._fetch(start, view)
            return
        futures: list[Future[None]] = []
        try:
            for offset in range(0, len(view), PART_SIZE):
                piece = view[offset : offset + PART_SIZE]
                futures.append(_pool().submit(self._fetch, start + offset, piece))
        finally:
            first = first_failure(futures)
            if first is not None:
                raise first

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` from the read position (less at the end of the file)."""
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self.size - self._pos))
        done = 0
        ahead_end = self._ahead_at + len(self._ahead)
        if self._ahead_at <= self._pos < ahead_end:
            count = min(want, ahead_end - self._pos)
            at = self._pos - self._ahead_at
            view[:count] = self._ahead[at : at + count]
            done = count
        rest = want - done
        if rest >= _DIRECT:
            self._fetch_many(self._pos + done, view[done:want])
            done = want
        elif rest:
            start = self._pos + done
            block = memoryview(bytearray(min(max(_WINDOW, rest), self.size - start)))
            self._ahead = memoryview(b"")
            self._fetch_many(start, block)
            self._ahead, self._ahead_at = block, start
            view[done:want] = block[:rest]
            done = want
        self._pos += done
        return done

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (everything that is left for ``n < 0``)."""
        left = self.size - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        out = bytearray(n)
        count = self.readinto(out)
        del out[count:]
        return bytes(out)
