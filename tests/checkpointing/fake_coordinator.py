"""An in-process stand-in for N processes, for the commit protocol's own tests.

:class:`FakeGroup` implements our :class:`~accelkit.checkpointing.commit.protocol.Coordinator`
interface (not a library's): each "process" is a thread, and ``exchange`` is an all-gather
in rounds, with every item pickled as ``all_gather_object`` does. ``lose`` makes one
process vanish when it reaches a given phase: it raises there, and the others' exchange of that
phase fails as a real collective does when a peer dies. Every phase each process reaches is
recorded in ``phases``.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FakeCoordinator", "FakeGroup", "run_ranks"]


class FakeGroup:
    """``world_size`` in-process "processes" that meet in rounds, one round per exchange."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.lose: dict[int, str] = {}
        self.phases: list[list[str]] = [[] for _ in range(world_size)]
        self._cond = threading.Condition()
        self._round = 0
        self._slots: dict[int, bytes] = {}
        self._results: dict[int, list[bytes]] = {}
        self._broken = False

    def coordinator(self, rank: int) -> FakeCoordinator:
        return FakeCoordinator(self, rank)

    def _meet(self, rank: int, phase: str, blob: bytes) -> list[bytes]:
        with self._cond:
            if self.lose.get(rank) == phase:
                self._broken = True
                self._cond.notify_all()
                raise ConnectionError(f"process {rank} vanished at {phase}")
            mine = self._round
            self._slots[rank] = blob
            if len(self._slots) == self.world_size:  # the last to arrive completes the round
                self._results[mine] = [self._slots[r] for r in range(self.world_size)]
                self._slots = {}
                self._round += 1
                self._cond.notify_all()
            else:
                self._cond.wait_for(lambda: self._round > mine or self._broken, self.timeout)
            if self._round > mine:  # completed: every process has the items, as in all_gather
                return self._results[mine]
            raise ConnectionError(f"a peer of process {rank} was lost at {phase}")


class FakeCoordinator:
    """One process's end of a :class:`FakeGroup`."""

    group: Any = None

    def __init__(self, hub: FakeGroup, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    def exchange(self, phase: str, item: Any) -> list[Any]:
        self.hub.phases[self.rank].append(phase)
        return [pickle.loads(blob) for blob in self.hub._meet(self.rank, phase, pickle.dumps(item))]


def run_ranks(hub: FakeGroup, body: Callable[[int, FakeCoordinator], Any]) -> list[Any]:
    """Run ``body(rank, coordinator)`` for every rank in its own thread; returns each rank's
    result, or the exception it raised."""
    results: list[Any] = [None] * hub.world_size

    def one(rank: int) -> None:
        try:
            results[rank] = body(rank, hub.coordinator(rank))
        except BaseException as exc:  # handed to the test, which asserts on it
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(hub.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a fake process hung"
    return results
