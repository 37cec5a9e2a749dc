"""The checkpoint code's named thread pools, created on first use and shared by the process.

``io`` writes O_DIRECT stages, ``fsync`` makes finished files durable, ``copy`` splits the
snapshot's host copies: separate pools, so that a slow ``fsync`` never delays a write or a copy.
``s3`` sends the parts of S3 uploads and fetches ranges: a *detached* pool, whose threads the
interpreter does not wait for at exit (see :func:`thread_pool`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from typing_extensions import override

__all__ = ["first_failure", "thread_pool"]

T = TypeVar("T")

_POOLS: dict[str, Executor] = {}
_LOCK = threading.Lock()


def thread_pool(name: str, workers: int, detached: bool = False) -> Executor:
    """The pool ``name`` (threads named ``accelkit-<name>``), made with ``workers`` threads by
    its first caller.

    Args:
        name: the pool's name.
        workers: its most threads (the first caller's value holds).
        detached: daemon threads that interpreter exit does not join. A
            :class:`~concurrent.futures.ThreadPoolExecutor`'s threads are joined at exit, so
            one request stalled on a paused server (s3fs's own timeouts and retries: minutes)
            holds the process after its work was given up (the replicator's drain deadline).
            Work that matters is waited for by whoever submitted it; a detached pool only lets
            go of work nobody waits for any more. The first caller's value holds.
    """
    with _LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            prefix = f"accelkit-{name}"
            pool = (
                _DetachedPool(workers, prefix)
                if detached
                else ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
            )
            _POOLS[name] = pool
        return pool


_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _DetachedPool(Executor):
    """A thread pool of daemon threads, started on demand up to ``workers`` (an idle one is
    reused first), that interpreter exit leaves running (see :func:`thread_pool`)."""

    def __init__(self, workers: int, prefix: str) -> None:
        self._workers = workers
        self._prefix = prefix
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    @override
    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the pool {self._prefix} is shut down")
            future: Future[T] = Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._workers:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            return future

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                    del exc
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs
            self._idle.release()

    @override
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in threads:
                self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()


def first_failure(futures: Iterable[Future[Any]]) -> BaseException | None:
    """Wait for every future (none is left running behind the caller's back) and return the
    first failure in their order, or ``None``."""
    first: BaseException | None = None
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            first = first or exc
    return first
