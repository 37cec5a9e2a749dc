"""A fault-injecting TCP proxy on 127.0.0.1, for storage outage tests.

It forwards every connection to an upstream server (SeaweedFS's S3 gateway) and, on demand,
breaks them as networks do: it resets a fraction of new connections, resets connections in the
middle of a stream, slows them down, or is fully down for a while (every new connection reset,
every open one cut). The client sees the same errors a real outage gives it (connection reset,
refused, cut mid-body), through its real network stack.

Example:
    >>> proxy = FaultProxy(("127.0.0.1", s3_server.port)).start()
    >>> options = {**s3_server.storage_options, "endpoint_url": proxy.endpoint_url}
    >>> proxy.drop_fraction = 0.3      # reset 30% of new connections
    >>> proxy.down_for(30)             # fully down for 30 s
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["FaultProxy"]

_BUF = 256 * 1024


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """A threaded TCP proxy from ``127.0.0.1:<free port>`` to ``upstream``.

    Attributes (change them while it runs):
        drop_fraction: fraction of new connections reset at once.
        reset_after_bytes: cut a connection (RST) once this many bytes went upstream through
            it (``None``: never); applies to ``reset_fraction`` of the connections.
        reset_fraction: fraction of connections ``reset_after_bytes`` applies to.
        reset_next: if set, ``reset_after_bytes`` applies to the next this many connections
            only (counted down), whatever ``reset_fraction`` says.
        bytes_per_second: upstream bandwidth per connection (``None``: unlimited).
        lose_reply_to: a byte string; the reply to the next request containing it (e.g.
            ``b"<CompleteMultipartUpload"``) is lost: the server got and handled the request,
            the client's connection is reset instead of getting the answer.
        lose_replies: how many such replies are lost (counted down).
        lost: replies lost so far.
        answers: whole HTTP responses; once ``lose_replies`` is spent, each next request
            containing ``lose_reply_to`` gets the first one left instead of being forwarded
            (the connection is then closed): what another S3 server would have answered.
        answered: requests answered so far.
    """

    def __init__(self, upstream: tuple[str, int], seed: int = 0) -> None:
        self.upstream = upstream
        self.drop_fraction = 0.0
        self.reset_after_bytes: int | None = None
        self.reset_fraction = 1.0
        self.reset_next: int | None = None
        self.bytes_per_second: float | None = None
        self.lose_reply_to: bytes | None = None
        self.lose_replies = 0
        self.lost = 0
        self.answers: list[bytes] = []
        self.answered = 0
        self.connections = 0
        self.dropped = 0
        self.cut = 0
        self._down_until = 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="faultproxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Start accepting; returns ``self``."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and cut every open connection."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def down(self) -> bool:
        """Whether the proxy is in a full outage now."""
        return time.monotonic() < self._down_until

    def down_for(self, seconds: float) -> None:
        """A full outage of ``seconds``: open connections are cut, new ones reset."""
        self._down_until = time.monotonic() + seconds
        self.cut_all()

    def up(self) -> None:
        """End an outage now."""
        self._down_until = 0.0

    def cut_all(self) -> None:
        """Reset every open connection (both sides)."""
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _reset(sock)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with self._lock:
                drop = self.down or self._rng.random() < self.drop_fraction
                if self.reset_next is not None:
                    chosen = self.reset_next > 0
                    self.reset_next = max(0, self.reset_next - 1)
                else:
                    chosen = self._rng.random() < self.reset_fraction
                cut = self.reset_after_bytes if chosen else None
            if drop:
                self.dropped += 1
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client, cut), daemon=True).start()

    def _serve(self, client: socket.socket, cut_after: int | None) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        with self._lock:
            self._open.update((client, upstream))
        done = threading.Event()
        armed = threading.Event()  # a request whose reply is to be lost went upstream
        canned = threading.Event()  # the client got `answer`: close it gently, no reset

        def pump(src: socket.socket, dst: socket.socket, limit: int | None, outbound: bool) -> None:
            # outbound: client -> server (slowed, cut, scanned for lose_reply_to)
            sent = 0
            tail = b""  # the marker may straddle two reads
            try:
                while True:
                    data = src.recv(_BUF)
                    if not data:
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        return
                    marker = self.lose_reply_to
                    if outbound and marker and marker in tail + data:
                        with self._lock:
                            if self.lose_replies > 0:
                                self.lose_replies -= 1
                                armed.set()
                            elif self.answers:
                                answer = self.answers.pop(0)
                                self.answered += 1
                                canned.set()
                        if canned.is_set():
                            with contextlib.suppress(OSError):  # the server never sees the rest
                                dst.shutdown(socket.SHUT_RDWR)
                            src.sendall(answer)
                            src.shutdown(socket.SHUT_WR)
                            return
                    # One byte short of a marker: a marker is never seen twice.
                    tail = (tail + data)[1 - len(marker) :] if marker and len(marker) > 1 else b""
                    if not outbound and armed.is_set():  # the server answered: lose the answer
                        self.lost += 1
                        raise OSError("reply lost by the proxy")
                    if limit is not None and sent + len(data) > limit:
                        self.cut += 1
                        raise OSError("cut by the proxy")
                    rate = self.bytes_per_second if outbound else None
                    if rate:
                        time.sleep(len(data) / rate)
                    dst.sendall(data)
                    sent += len(data)
                    if self.down:
                        raise OSError("outage")
            except OSError:
                if canned.is_set():  # the client reads the answer; only the server goes
                    _reset(dst if outbound else src)
                    return
                _reset(src)
                _reset(dst)
            finally:
                done.set()

        up = threading.Thread(target=pump, args=(client, upstream, cut_after, True), daemon=True)
        up.start()
        pump(upstream, client, None, False)
        up.join()
        with self._lock:
            self._open.discard(client)
            self._open.discard(upstream)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.close()
