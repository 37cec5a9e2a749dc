"""Samplers that shard a dataloader across processes.

* :class:`SeedableRandomSampler`: a ``RandomSampler`` whose order is a pure function of
  ``(seed, epoch)``, so every process shuffles identically and a position can be restored.
* :class:`RecordedRandomSampler`: a ``RandomSampler`` (same orders) whose per-pass randomness
  can be recorded and replayed, for resuming a pass without drawing again.
* :class:`BatchSamplerShard`: gives process ``r`` of ``P`` its share of a batch sampler's batches
  (or of every batch, with ``split_batches``), padding the last round by wrapping around to the
  first samples so every process gets as many full batches (``even_batches``).
* :class:`IterableDatasetShard`: the same for an ``IterableDataset``.

These hold no process-group state: ``num_processes`` and ``process_index`` are passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import IterableDataset, RandomSampler, Sampler

from accelkit.errors import ConfigurationError

__all__ = [
    "BatchSamplerShard",
    "IterableDatasetShard",
    "RecordedRandomSampler",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "draw_seed",
]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` drawing its order from ``initial_seed + epoch``.

    The order of a pass is a pure function of the seed and the epoch, so every process
    shuffles identically and a pass can be replayed. ``epoch`` advances by one after each full
    pass (a prepared dataloader also sets it before each pass).

    Args:
        data_source: the dataset.
        replacement: sample with replacement.
        num_samples: samples per epoch (default: the dataset's length).
        generator: the generator to reseed for each pass (default: a private one).
        data_seed: the base seed (default: ``torch.initial_seed()``, which ``set_seed`` sets).
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        *,
        data_seed: int | None = None,
    ) -> None:
        super().__init__(
            data_source, replacement=replacement, num_samples=num_samples, generator=generator
        )
        self.initial_seed = int(data_seed if data_seed is not None else torch.initial_seed())
        self.epoch = 0

    @property
    def seed(self) -> int:
        """The base seed (``initial_seed``)."""
        return self.initial_seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.initial_seed = int(value)

    def set_epoch(self, epoch: int) -> None:
        """Select the order of epoch ``epoch``."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def draw_seed() -> int:
    """A seed drawn from the global torch RNG, as ``RandomSampler`` draws one per pass."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class RecordedRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose randomness can be recorded and replayed.

    It shuffles exactly as ``RandomSampler`` does: with a ``generator``, from that generator's
    current state; without one, from a seed drawn from the global torch RNG at the start of
    each pass. That seed is kept in :attr:`last_seed`, and a seed put in :attr:`replay_seed` is
    used (instead of a draw) by the next pass, so a pass interrupted by a checkpoint can be
    replayed without drawing again.
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(
            data_source, replacement=replacement, num_samples=num_samples, generator=generator
        )
        self.last_seed: int | None = None
        self.replay_seed: int | None = None

    def __iter__(self) -> Iterator[int]:
        if self.generator is not None:
            yield from super().__iter__()
            return
        seed = self.replay_seed if self.replay_seed is not None else draw_seed()
        self.replay_seed = None
        self.last_seed = seed
        generator = torch.Generator()
        generator.manual_seed(seed)
        yield from RandomSampler(
            self.data_source,
            replacement=self.replacement,
            num_samples=self._num_samples,
            generator=generator,
        )


class SkipBatchSampler(Sampler[list[int]]):
    """Yield a batch sampler's batches except the first ``skip_batches``."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        """Batches of the wrapped batch sampler, skipped ones included."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return max(0, self.total_length - self.skip_batches)


def _check_split(batch_size: int | None, num_processes: int) -> None:
    if batch_size is None or batch_size % num_processes != 0:
        raise ConfigurationError(
            f"split_batches=True needs a batch size divisible by the number of processes; got "
            f"batch_size={batch_size} on {num_processes} processes. Use a batch size that is a "
            f"multiple of {num_processes}, or split_batches=False."
        )


class BatchSamplerShard(Sampler[list[int]]):
    """Process ``process_index``'s share of the batches of ``batch_sampler``.

    Without ``split_batches``, the batches are dealt round-robin: process ``r`` gets batches
    ``r, r + P, r + 2P, ...``. With it, every batch is cut into ``P`` equal slices and process
    ``r`` gets slice ``r``. When the samples run out part-way through a round, ``even_batches``
    completes the round with samples from the start of the epoch, so every process yields the
    same number of full batches; those repeated samples are what ``gather_for_metrics`` drops.

    Args:
        batch_sampler: the dataloader's batch sampler.
        num_processes: ``P``.
        process_index: ``r``.
        split_batches: split each batch instead of dealing whole batches.
        even_batches: pad the last round (ignored with ``drop_last``, which drops it).
        skip_batches: leave out this process's first ``skip_batches`` batches on every pass.

    Attributes:
        pass_skip: batches to leave out at the start of the current pass, on top of
            ``skip_batches`` (a prepared dataloader sets it before each pass; not in ``len()``).
        pass_skip_global: batches *of the wrapped batch sampler* to leave out at the start of
            the current pass, before they are dealt or split: a position of the epoch's global
            order, the same on any number of processes (a run resumed on another process count
            starts there). The skipped batches still count as the epoch's first ones for the
            padding of the last round.

    Raises:
        ValueError: for ``split_batches`` with a batch size not divisible by ``P``.
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
        skip_batches: int = 0,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        self.skip_batches = skip_batches
        self.pass_skip = 0
        self.pass_skip_global = 0
        if split_batches and num_processes > 1:
            _check_split(self.batch_size, num_processes)

    @property
    def sampler(self) -> Any:
        """The sample-level sampler of the wrapped batch sampler (if it has one)."""
        return getattr(self.batch_sampler, "sampler", None)

    def _full_length(self) -> int:
        n = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.split_batches or self.num_processes == 1:
            return n
        rounds, extra = divmod(n, self.num_processes)
        if extra == 0 or self.drop_last:
            return rounds
        if self.even_batches:
            return rounds + 1
        return rounds + (1 if self.process_index < extra else 0)

    def __len__(self) -> int:
        return max(0, self._full_length() - self.skip_batches)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the skip is read when the first batch is asked for, not when the
        # iterator is made (a StatefulDataLoader may make one early, for its state_dict()).
        skip = self.skip_batches + self.pass_skip
        if self.num_processes == 1:
            batches: Iterator[list[int]] = itertools.islice(
                iter(self.batch_sampler), self.pass_skip_global, None
            )
        elif self.split_batches:
            batches = self._iter_split()
        else:
            batches = self._iter_dealt()
        if skip:
            batches = itertools.islice(batches, skip, None)
        yield from batches

    def _iter_dealt(self) -> Iterator[list[int]]:
        size, rank, bs = self.num_processes, self.process_index, self.batch_size
        head: list[list[int]] = []  # the first round's batches, to wrap around to
        round_: list[list[int]] = []
        left_out = self.pass_skip_global
        for batch in self.batch_sampler:
            if len(head) < size:
                head.append(batch)
            if left_out:
                left_out -= 1
                continue
            round_.append(batch)
            if len(round_) == size and (bs is None or len(batch) == bs):
                yield round_[rank]
                round_ = []
        if not round_ or self.drop_last:
            return
        if not self.even_batches:
            if rank < len(round_) and round_[rank]:
                yield round_[rank]
            return
        if bs is None:  # variable-size batches: complete the round with whole batches
            filler = itertools.cycle(head)
            while len(round_) < size:
                round_.append(next(filler))
            yield round_[rank]
            return
        yield self._padded(round_, head, size * bs)[rank * bs : (rank + 1) * bs]

    def _iter_split(self) -> Iterator[list[int]]:
        size, rank, bs = self.num_processes, self.process_index, self.batch_size
        assert bs is not None
        per = bs // size
        head: list[list[int]] = []
        left_out = self.pass_skip_global
        for batch in self.batch_sampler:
            if not head:
                head.append(batch)
            if left_out:
                left_out -= 1
                continue
            if len(batch) < bs:
                if self.drop_last:
                    return
                if self.even_batches:
                    batch = self._padded([batch], head, bs)
                else:  # as the reference: the first processes get full slices
                    if batch[rank * per : (rank + 1) * per]:
                        yield batch[rank * per : (rank + 1) * per]
                    return
            yield batch[rank * per : (rank + 1) * per]

    @staticmethod
    def _padded(batches: list[list[int]], head: list[list[int]], total: int) -> list[int]:
        flat = [i for b in batches for i in b]
        filler = itertools.cycle([i for b in head for i in b])
        while len(flat) < total:
            flat.append(next(filler))
        return flat


def _share(length: int, parts: int, index: int) -> tuple[int, int]:
    per, extra = divmod(length, parts)
    start = index * per + min(index, extra)
    return start, start + per + (1 if index < extra else 0)


class IterableDatasetShard(IterableDataset[Any]):
    """Process ``process_index``'s share of an ``IterableDataset``.

    Every process reads the whole stream, in buffers of ``batch_size`` samples (the global batch:
    per-process batch size times ``P``, or the batch size itself with ``split_batches``), and
    keeps its slice of each buffer. The last, short buffer is completed with the first samples
    (``even_batches``), dropped (``drop_last``), or cut unevenly.

    Attributes:
        pass_skip_samples: samples of the stream to leave out at the start of the current pass
            (a position of the epoch's global order, the same on any number of processes; they
            still count as the epoch's first samples for the padding of the last buffer).
        last_remainder: after a full pass, the real samples in the final buffer (0 if it was not
            padded), so ``gather_for_metrics`` can drop the padding even without ``len()``.
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int,
        num_processes: int = 1,
        process_index: int = 0,
        drop_last: bool = False,
        even_batches: bool = True,
    ) -> None:
        if batch_size % num_processes != 0:
            _check_split(batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.pass_skip_samples = 0
        self.last_remainder = -1

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped dataset if it takes one."""
        fn = getattr(self.dataset, "set_epoch", None)
        if callable(fn):
            fn(epoch)

    def __len__(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        per = self.batch_size // self.num_processes
        rounds = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return rounds * per

    def __iter__(self) -> Iterator[Any]:
        per = self.batch_size // self.num_processes
        lo, hi = self.process_index * per, (self.process_index + 1) * per
        head: list[Any] = []
        buffer: list[Any] = []
        self.last_remainder = -1
        left_out = self.pass_skip_samples
        for item in self.dataset:
            if len(head) < self.batch_size:
                head.append(item)
            if left_out:
                left_out -= 1
                continue
            buffer.append(item)
            if len(buffer) == self.batch_size:
                yield from buffer[lo:hi]
                buffer = []
        if not buffer or self.drop_last:
            self.last_remainder = 0
            return
        self.last_remainder = len(buffer)
        if not self.even_batches or self.num_processes == 1:
            start, end = _share(len(buffer), self.num_processes, self.process_index)
            yield from buffer[start:end]
            return
        filler = itertools.cycle(head)
        while len(buffer) < self.batch_size:
            buffer.append(next(filler))
        yield from buffer[lo:hi]
