"""The random streams of a prepared loader's worker processes, carried across a resume.

With ``num_workers > 0`` the samples are read (and a dataset's augmentations drawn) in worker
processes. PyTorch seeds each worker at the start of a pass (``base_seed + worker id``, the base
drawn when the pass's iterator is made) and hands the batches out round-robin; each worker's
Python, NumPy and torch generators then advance with every batch it reads. A resumed pass makes
new workers: a new base seed, each stream at its start, and the first batch given to worker 0
instead of the worker whose turn it was. So the resumed epoch's augmentations differ from the
uninterrupted run's, silently (in Accelerate too).

Here each worker sends, with every batch it reads, its generator states after reading it (a
:class:`TaggedBatch`; nothing while its generators have not moved, so a dataset without
randomness costs one comparison per batch), and the *role* it plays (the worker id of the
uninterrupted run). The training process keeps, per role, the states after the last batch
before the one read ahead (:class:`WorkerStreams`); the loader saves them with its position
(``"worker_rng"``). A resumed pass starts its workers through :class:`WorkerStart`: worker
``i`` plays role ``(next + i) % num_workers``, where ``next`` is the role whose turn the read-
ahead batch was, and starts from that role's saved states (or, for a role that had read nothing
yet, from the seeds PyTorch gave it), after the user's ``worker_init_fn``. The resumed epoch then
draws what the uninterrupted one drew.

Not covered (a resume is then as PyTorch makes it): ``persistent_workers=True`` (the workers
outlive the pass), ``in_order=False`` (batches come out as they are ready: no resume replays
that order), iterable datasets (the workers shard the stream themselves) and batches the main
process dispatches. ``torch.utils.data.get_worker_info().seed`` in a resumed worker is the
resumed pass's seed.

Public API: :class:`TaggedBatch`, :class:`TaggingCollate`, :class:`WorkerStart`,
:class:`WorkerStreams`.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from accelkit.errors import ConfigurationError
from accelkit.runtime.random import (
    checked_generator_states,
    global_generator_states,
    set_global_generator_states,
)

__all__ = ["TaggedBatch", "TaggingCollate", "WorkerStart", "WorkerStreams"]


class TaggedBatch(NamedTuple):
    """A batch as a worker sends it: the batch, the role of the worker that read it, the
    pass's base seed, and the worker's generator states after reading it (pickled, so that
    pinning leaves them alone; None while they have not moved)."""

    batch: Any
    role: int
    base_seed: int
    states: bytes | None


class _Worker:
    """What one worker process knows about its role (set by :class:`WorkerStart`)."""

    role = 0
    base_seed = 0
    start: bytes | None = None  # the generator states before the first batch, pickled


def _states() -> bytes:
    """This worker's generator states, pickled (torch's as a NumPy array: a tensor's pickle
    is not the same bytes for the same values, and the bytes are compared)."""
    states = global_generator_states()
    states["torch"] = states["torch"].numpy()
    return pickle.dumps(states, protocol=pickle.HIGHEST_PROTOCOL)


def _unpickled(blob: bytes) -> dict[str, Any]:
    states = pickle.loads(blob)  # from this run's own workers, never from a file
    states["torch"] = torch.from_numpy(states["torch"])
    return states


class TaggingCollate:
    """A loader's ``collate_fn`` that, in a worker, tags each batch (:class:`TaggedBatch`)."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        if get_worker_info() is None:  # not in a worker (never with workers)
            return batch
        states = _states()
        moved = None if states == _Worker.start else states
        return TaggedBatch(batch, _Worker.role, _Worker.base_seed, moved)


class WorkerStart:
    """A loader's ``worker_init_fn``: sets up the worker's role, then calls the user's.

    Args:
        user: the ``worker_init_fn`` the user gave (or None).
        plan: for a resumed pass, what :meth:`WorkerStreams.record` saved; None otherwise.
    """

    def __init__(self, user: Callable[[int], Any] | None, plan: dict[str, Any] | None) -> None:
        self.user = user
        self.plan = plan

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        assert info is not None
        plan = self.plan
        base = info.seed - worker_id
        role = worker_id
        resumed: dict[str, Any] | None = None
        if plan is not None and plan["workers"] == info.num_workers:
            base = int(plan["base_seed"])
            role = (int(plan["next"]) + worker_id) % info.num_workers
            resumed = dict(plan["states"]).get(role)
            if resumed is None:
                _seed_as(base, role)
        _Worker.role, _Worker.base_seed = role, base
        if self.user is not None:
            self.user(worker_id)
        if resumed is not None:
            set_global_generator_states(resumed)
        _Worker.start = _states()


def _seed_as(base_seed: int, role: int) -> None:
    """Seed this worker's generators as PyTorch seeds worker ``role`` of a pass whose base seed
    is ``base_seed``."""
    random.seed(base_seed + role)
    torch.manual_seed(base_seed + role)
    from torch.utils.data._utils import worker as torch_worker  # NumPy's seed derivation

    np.random.seed(torch_worker._generate_state(base_seed, role))


class WorkerStreams:
    """The training process's record of its workers' generator states, for one pass."""

    __slots__ = ("_held", "_kept", "base_seed", "workers")

    def __init__(self) -> None:
        self.workers = 0
        self.base_seed = 0
        # role -> states after its last batch before the held one (pickled, or as restored)
        self._kept: dict[int, bytes | dict[str, Any]] = {}
        self._held: tuple[int, bytes | None] | None = None  # the batch read ahead: role, states

    def start_pass(self, workers: int, plan: dict[str, Any] | None = None) -> None:
        """A new pass with ``workers`` workers: nothing kept, or, for a pass resumed by
        ``plan``, the saved states of the roles (kept until a role reads a batch again)."""
        self.workers = workers
        self._kept = {}
        self._held = None
        if plan is not None and plan["workers"] == workers:
            self.base_seed = plan["base_seed"]
            self._kept = dict(plan["states"])

    def untagged(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The batches of ``batches``, their tags kept: a batch read commits the one before
        (which the loop has handed out by then)."""
        for item in batches:
            if isinstance(item, TaggedBatch):
                self.base_seed = item.base_seed
                if self._held is not None and self._held[1] is not None:
                    self._kept[self._held[0]] = self._held[1]
                self._held = (item.role, item.states)
                item = item.batch
            yield item

    def record(self) -> dict[str, Any] | None:
        """What a resume needs (``"worker_rng"`` of the loader's state), or None when no worker
        has drawn a random number yet this pass (a resume then seeds them as this pass did)."""
        if self._held is None or (not self._kept and self._held[1] is None):
            return None
        return {
            "workers": self.workers,
            "base_seed": self.base_seed,
            "next": self._held[0],
            "states": [
                [role, _unpickled(kept) if isinstance(kept, bytes) else kept]
                for role, kept in sorted(self._kept.items())
            ],
        }


def checked_plan(plan: Any) -> dict[str, Any]:
    """A saved ``"worker_rng"`` entry in the form :class:`WorkerStart` takes.

    Raises:
        ValueError: naming what is malformed.
    """
    try:
        workers, base, first = (int(plan[key]) for key in ("workers", "base_seed", "next"))
        states = {int(role): checked_generator_states(s) for role, s in plan["states"]}
    except (TypeError, KeyError, ValueError) as exc:
        raise ConfigurationError(
            f"expected workers, base_seed, next and per-role states ({exc})"
        ) from None
    if not (workers > 0 and 0 <= first < workers and all(0 <= r < workers for r in states)):
        raise ConfigurationError(f"roles out of range for {workers} workers")
    return {"workers": workers, "base_seed": base, "next": first, "states": states}
