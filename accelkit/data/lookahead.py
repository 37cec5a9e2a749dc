"""What a prepared dataloader will hand out next, computed without handing it out.

A resume is exact only if the first batches after ``load_state()`` are the batches the saved run
would have taken next. :func:`upcoming_batches` answers "which sample indices come next" from a
prepared loader's public state (its ``state_dict()``: epoch, batches yielded, shuffling seed and
randomness; its batch sampler), the way the loader's next pass will start there: the
shuffling randomness the state records is put into copies of the samplers and their
generators, the pass is run on the copies up to the position, and everything is left as it
was (the loader, its samplers, their generators, and Python's, NumPy's and torch's global
generators, which a sampler may draw from).

It is called once when a checkpoint is saved and once at the first step after a resume
(:mod:`accelkit._accelerator.resume`), never per batch.

Public API: :func:`upcoming_batches`, :func:`per_process_batch_size`, :func:`sampler_summary`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from accelkit.data.prepared import is_prepared
from accelkit.data.sampling import BatchSamplerShard, RecordedRandomSampler, SeedableRandomSampler
from accelkit.runtime.random import global_generator_states, set_global_generator_states

__all__ = ["MAX_SAMPLES", "per_process_batch_size", "sampler_summary", "upcoming_batches"]

logger = logging.getLogger(__name__)

MAX_SAMPLES = 2_000_000
"""Above this many samples per pass a loader's next batches are not replayed: its shuffle would
cost about a second and a list of that many indices at every save (measured: 0.3 s for a
million samples)."""


def _shard_of(loader: Any) -> BatchSamplerShard | None:
    """The loader's shard of the batches (where ``prepare`` put it), or None (an iterable
    dataset, or batches the main process dispatches)."""
    for candidate in (
        getattr(loader, "batch_sampler", None),
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "sampler", None), "shard", None),  # batch_size=None
    ):
        if isinstance(candidate, BatchSamplerShard):
            return candidate
    return None


def per_process_batch_size(loader: Any, num_processes: int) -> int | None:
    """Samples per batch on this process (None when the loader does not say)."""
    total = getattr(loader, "total_batch_size", None)
    if isinstance(total, int) and num_processes > 0:
        return total // num_processes
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


def sampler_summary(loader: Any) -> str:
    """The sample-level sampler a prepared loader shuffles with: its class, how many samples
    it draws from and, where it has one, its seed (``"RecordedRandomSampler over 96 samples"``,
    ``"DistributedSampler over 96 samples, seed 3"``)."""
    shard = _shard_of(loader)
    if shard is None:
        return type(getattr(loader, "dataset", None)).__name__
    sampler = shard.sampler
    if sampler is None:
        return type(shard.batch_sampler).__name__
    text = type(sampler).__name__
    try:
        text += f" over {len(sampler)} samples"
    except TypeError:  # a sampler without a length
        pass
    seed = getattr(sampler, "seed", None)
    if isinstance(seed, int):
        text += f", seed {seed}"
    return text


def upcoming_batches(loader: Any, count: int) -> list[list[Any]] | None:
    """The sample indices of the next ``count`` batches ``loader`` yields from the position
    its ``state_dict()`` describes (fewer at the end of the epoch), changing nothing.

    Args:
        loader: a prepared dataloader.
        count: how many batches to look ahead.

    Returns:
        One list of indices per batch; None for a loader whose indices are not known before
        its data is read (an iterable dataset, batches the main process dispatches, a loader
        that is not prepared), whose pass is longer than :data:`MAX_SAMPLES`, or whose sampler
        cannot be copied and run (said in a log line).
    """
    shard = _shard_of(loader) if is_prepared(loader) else None
    if shard is None or _samples(shard) > MAX_SAMPLES:
        return None
    state = loader.state_dict()
    try:
        with _global_generators_kept():
            batches = _replay(loader, shard, state)
            return [list(batch) for batch in itertools.islice(batches, count)]
    except Exception as exc:  # a user's sampler we cannot run twice: no indices to compare
        logger.info(
            "The next batches of %s are not compared on resume: its sampler could not be "
            "copied and run (%s: %s).",
            type(loader).__name__,
            type(exc).__name__,
            exc,
        )
        return None


def _samples(shard: BatchSamplerShard) -> int:
    """Samples in one pass of ``shard``'s sampler (0 when it does not say)."""
    try:
        return len(shard.sampler) if shard.sampler is not None else 0
    except TypeError:  # a sampler without a length
        return 0


def _replay(loader: Any, shard: BatchSamplerShard, state: dict[str, Any]) -> Iterator[Any]:
    """Copies of the loader's shard, batch sampler and sampler, set as the loader's next pass
    will set them from ``state``; their batches from the position on."""
    epoch = int(state.get("epoch", 0))
    position = int(state.get("batches_yielded", 0))
    randomness = state.get("randomness") or {}
    clones: dict[int, torch.Generator] = {}

    def clone(generator: Any) -> Any:
        if not isinstance(generator, torch.Generator):
            return generator
        if id(generator) not in clones:
            fresh = torch.Generator(device=generator.device)
            fresh.set_state(generator.get_state())
            clones[id(generator)] = fresh
        return clones[id(generator)]

    shard = copy.copy(shard)
    batch_sampler = shard.batch_sampler = copy.copy(shard.batch_sampler)
    original = getattr(batch_sampler, "sampler", None)
    sampler = None if original is None else copy.copy(original)
    if sampler is not None:
        batch_sampler.sampler = sampler  # type: ignore[attr-defined]
        if isinstance(getattr(sampler, "generator", None), torch.Generator):
            sampler.generator = clone(sampler.generator)
    # The generators whose states the position records, in the loader's order: the recorded
    # sampler's, then the loader's own.
    recorded = original if isinstance(original, RecordedRandomSampler) else None
    generators: list[Any] = []
    for generator in (None if recorded is None else recorded.generator, loader.generator):
        if generator is not None and all(generator is not g for g in generators):
            generators.append(generator)
    for generator, saved in zip(generators, randomness.get("generator_states") or ()):
        if isinstance(saved, torch.Tensor):
            clone(generator).set_state(saved.reshape(-1).clone())
    if isinstance(sampler, RecordedRandomSampler):
        # A pass under way replays its recorded seed; a new pass draws (from the kept globals).
        sampler.replay_seed = randomness.get("sampler_seed") if position > 0 else None
    if isinstance(sampler, SeedableRandomSampler) and state.get("seed") is not None:
        sampler.seed = int(state["seed"])
    for target in (batch_sampler, sampler):
        set_epoch = getattr(target, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
    if position == 0 and not state.get("first_pass_drawn"):
        # A pass that starts afresh makes its iterator first, which draws the workers' base
        # seed from the loader's generator (or the global one) before the sampler draws; a
        # resumed pass, or one whose draw prepare() made, draws nothing (see prepared.py).
        torch.empty((), dtype=torch.int64).random_(generator=clone(loader.generator))
    shard.pass_skip = position
    return iter(shard)


@contextlib.contextmanager
def _global_generators_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's global generator states, put back on exit."""
    kept = global_generator_states()
    try:
        yield
    finally:
        set_global_generator_states(kept)
