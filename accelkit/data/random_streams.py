"""What a prepared loader keeps of the random numbers its reads draw, saved with its position.

One :class:`RandomStreams` belongs to a loader's position (shared with the loaders
``skip_first_batches`` makes). It joins the two records a mid-epoch resume needs to draw what
the uninterrupted run drew: the generator states of the batch read ahead in the training
process (:mod:`accelkit.data.readahead`, saved as ``"read_ahead_rng"``) and those of the loader's
workers (:mod:`accelkit.data.worker_streams`, saved as ``"worker_rng"``); and it holds the
restored ones until the pass that goes on where the saved one stopped.

Public API: :class:`RandomStreams`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from accelkit.data.readahead import ReadAheadRandomness, read_under
from accelkit.data.worker_streams import TaggingCollate, WorkerStart, WorkerStreams, checked_plan
from accelkit.errors import ConfigurationError
from accelkit.runtime.random import checked_generator_states, global_generator_states

__all__ = ["READ_AHEAD_KEY", "WORKERS_KEY", "RandomStreams", "tags_workers"]

READ_AHEAD_KEY = "read_ahead_rng"
WORKERS_KEY = "worker_rng"

_Saved = tuple[dict[str, Any] | None, dict[str, Any] | None]  # read-ahead states, worker plan


def tags_workers(loader: Any) -> bool:
    """Whether ``loader``'s workers can send their generator states with its batches: it has
    workers, they are started afresh for every pass (not ``persistent_workers``), and it hands
    their batches out in turn (not ``in_order=False``, which yields whichever is ready, so that
    no resume can replay its order). (The loader also needs a map-style dataset whose batches
    it does not dispatch.)"""
    return (
        getattr(loader, "num_workers", 0) > 0
        and not getattr(loader, "persistent_workers", False)
        and getattr(loader, "in_order", True)
    )


class RandomStreams:
    """A loader position's record of its reads' random numbers (see the module docstring)."""

    __slots__ = ("_resume", "pending", "read_ahead", "workers")

    def __init__(self) -> None:
        self.read_ahead = ReadAheadRandomness()
        self.workers = WorkerStreams()
        self.pending: _Saved = (None, None)  # restored by a load, for the next pass
        self._resume: _Saved = (None, None)  # what the pass under way resumes from

    @staticmethod
    def checked(state: Mapping[str, Any]) -> _Saved:
        """The records a loader state holds, checked (for :attr:`pending`).

        Raises:
            ValueError: naming the entry that is malformed.
        """
        out: list[dict[str, Any] | None] = []
        for key, check in ((READ_AHEAD_KEY, checked_generator_states), (WORKERS_KEY, checked_plan)):
            raw = state.get(key)
            try:
                out.append(None if raw is None else check(raw))
            except ValueError as exc:
                raise ConfigurationError(f"its {key!r} entry: {exc}") from None
        return out[0], out[1]

    def record(self, restored: bool) -> dict[str, Any]:
        """The entries for a mid-epoch loader state: the restored ones while the loader has
        not read since the load (``restored``), else this pass's."""
        read_ahead, workers = (
            self.pending if restored else (self.read_ahead.held, self.workers.record())
        )
        out: dict[str, Any] = {}
        if read_ahead is not None:
            out[READ_AHEAD_KEY] = read_ahead
        if workers is not None:
            out[WORKERS_KEY] = workers
        return out

    def start_pass(self, resumes: bool) -> None:
        """A pass starts; ``resumes``: it goes on where the saved one stopped (its first batch
        is the one the saved run had read ahead), so it takes the restored records."""
        self._resume = self.pending if resumes else (None, None)
        self.pending = (None, None)
        self.read_ahead.start_pass()

    @contextlib.contextmanager
    def worker_hooks(self, loader: Any, tags: bool) -> Iterator[None]:
        """While ``loader`` makes its iterator (and starts its workers): with ``tags``, its
        ``collate_fn`` tags each batch with the worker's generator states and its
        ``worker_init_fn`` starts a resumed pass's workers from the saved ones; the loader's
        attributes are the user's again afterwards."""
        if not tags:
            yield
            return
        collate, init = loader.collate_fn, loader.worker_init_fn
        loader.collate_fn = TaggingCollate(collate)
        loader.worker_init_fn = WorkerStart(init, self._resume[1])
        try:
            yield
        finally:
            loader.collate_fn, loader.worker_init_fn = collate, init

    def untagged(self, batches: Iterator[Any], workers: int) -> Iterator[Any]:
        """The pass's batches from tagging workers, their tags kept."""
        self.workers.start_pass(workers, self._resume[1])
        return self.workers.untagged(batches)

    def first_read(self, read_next: Callable[[], Any], drop: int, end: Any) -> Any:
        """The pass's first batch, after reading and dropping ``drop`` (an iterable dataset's
        resume): for a resumed pass, read from the saved read-ahead states, with the generators
        left as they were before the drops."""
        held, self._resume = self._resume[0], (None, None)
        kept = global_generator_states(held) if held is not None and drop else None
        for _ in range(drop):
            if read_next() is end:
                break
        return read_next() if held is None else read_under(held, read_next, kept)
