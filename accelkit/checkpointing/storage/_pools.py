"""The checkpoint code's named thread pools, created on first use and shared by the process.

``io`` writes O_DIRECT stages, ``fsync`` makes finished files durable, ``copy`` splits the
snapshot's host copies: separate pools, so that a slow ``fsync`` never delays a write or a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["first_failure", "thread_pool"]

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def thread_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The pool ``name`` (threads named ``accelkit-<name>``), made with ``workers`` threads by
    its first caller."""
    with _LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"accelkit-{name}")
            _POOLS[name] = pool
        return pool


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
