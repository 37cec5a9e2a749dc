"""settle_collective_threads: the exit hook waits until gloo's worker threads are done.

The workers here are Python threads that give themselves the OS name torch gives its gloo
workers (``pt_gloo_runloop``), so the waiting logic is tested exactly: one that still has work
(running with the GIL released, as a C++ worker does) must finish before the call returns. The
real abort it prevents is exercised by tests/distributed/test_exit.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from accelkit.runtime.teardown import settle_collective_threads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="threads are read from /proc (Linux only)"
)

_PR_SET_NAME = 15


def _name_this_thread(name: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) == 0


def _busy(seconds: float) -> None:
    """Use the CPU for about ``seconds`` with the GIL released (hashlib releases it)."""
    block = b"x" * (8 << 20)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hashlib.sha256(block).digest()


class _Worker:
    """A thread named like a gloo worker that runs ``job`` when started, then sleeps."""

    def __init__(self, job: Callable[[], None]) -> None:
        self.go, self.done, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.named = threading.Event()

        def run() -> None:
            _name_this_thread(b"pt_gloo_runloop")
            self.named.set()
            self.go.wait()
            job()
            self.done.set()
            self.stop.wait()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.named.wait(5)

    def close(self) -> None:
        self.go.set()
        self.stop.set()
        self.thread.join(30)


@pytest.fixture
def worker() -> Iterator[Callable[[Callable[[], None]], _Worker]]:
    made: list[_Worker] = []

    def make(job: Callable[[], None]) -> _Worker:
        made.append(_Worker(job))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_returns_at_once_without_gloo_workers() -> None:
    assert settle_collective_threads(timeout_s=5.0) is True


def test_waits_for_a_worker_that_still_has_work(worker) -> None:
    busy = worker(lambda: _busy(0.3))
    interval = sys.getswitchinterval()
    # As in the abort: the main thread would keep the GIL long after the worker asks for it.
    sys.setswitchinterval(0.5)
    try:
        busy.go.set()
        assert settle_collective_threads(timeout_s=10.0) is True
        assert busy.done.is_set(), "returned while the worker was still running"
        assert sys.getswitchinterval() == 0.5, "the script's switch interval is restored"
    finally:
        sys.setswitchinterval(interval)


def test_an_idle_worker_settles_in_a_few_polls(worker) -> None:
    idle = worker(lambda: None)
    idle.go.set()
    assert idle.done.wait(5)
    assert settle_collective_threads(timeout_s=10.0, quiet_polls=5, poll_s=0.002) is True


@pytest.mark.slow
def test_gives_up_at_the_timeout_on_a_worker_that_never_sleeps(worker) -> None:
    spinning = worker(lambda: _busy(3.0))
    spinning.go.set()
    assert settle_collective_threads(timeout_s=0.2) is False
    assert not spinning.done.is_set(), "waited past its timeout"
