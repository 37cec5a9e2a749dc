"""Where an epoch is in its *global* order, the same on any number of processes.

A prepared loader deals the batches of the user's batch sampler (or the samples of an iterable
dataset) to the processes; what every process together has consumed of an epoch is a place in
that global order, and it does not depend on the process count. :class:`GlobalOrder` knows how
one loader's batches map onto it: the record a checkpoint keeps (``"global_position"``), the
units a run resumed on another number of processes leaves out before dealing, and how the
shuffling generator's role differs between one process and several
(:class:`Shuffling`). :mod:`accelkit.data.prepared` drives them.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from accelkit.data.dispatch import Dispatch
from accelkit.data.sampling import BatchSamplerShard, IterableDatasetShard, RecordedRandomSampler
from accelkit.errors import ConfigurationError

__all__ = ["GLOBAL_POSITION", "GlobalOrder", "Shuffling"]

GLOBAL_POSITION = "global_position"
"""The key of a saved dataloader position's global record."""


class GlobalOrder:
    """How one prepared loader's batches map onto its epoch's global order.

    A *unit* of the global order is a batch of the user's batch sampler (a map-style dataset,
    or dispatching) or a sample (an iterable dataset read by every process).

    Args:
        dispatch: the loader's dispatching, if it dispatches.
        shard: its batch sampler shard (a map-style dataset).
        iterable_shard: its iterable dataset shard.
        batching: with dispatching, how the main process batches (``batch_size`` or
            ``batch_sampler``).
    """

    def __init__(
        self,
        dispatch: Dispatch | None,
        shard: BatchSamplerShard | None,
        iterable_shard: IterableDatasetShard | None,
        batching: dict[str, Any],
    ) -> None:
        self.dispatch = dispatch
        self.shard = shard
        self.iterable_shard = iterable_shard
        self.batching = batching
        self.dispatch_skip = 0  # dispatching: the user's batches the main process leaves out

    @property
    def num_processes(self) -> int:
        """The processes the data is shared between."""
        for part in (self.dispatch, self.shard, self.iterable_shard):
            if part is not None:
                return int(part.num_processes)
        return 1

    @property
    def units_per_step(self) -> int:
        """The units one batch of every process consumes together."""
        if self.dispatch is not None:
            return 1 if self.dispatch.split_batches else self.dispatch.num_processes
        if self.shard is not None:
            return 1 if self.shard.split_batches else self.shard.num_processes
        if self.iterable_shard is not None:
            return self.iterable_shard.batch_size
        return 1

    def unit(self) -> tuple[str, int | None]:
        """What a unit is (``"batches"`` or ``"samples"``) and the samples it holds (None:
        batches of varying or unknown size)."""
        if self.dispatch is None and self.iterable_shard is not None:
            return "samples", 1
        if self.shard is not None:
            return "batches", self.shard.batch_size
        size = self.batching.get("batch_size")
        sampler = self.batching.get("batch_sampler")
        if size is None and sampler is not None:
            size = getattr(sampler, "batch_size", None)
        return "batches", size

    def record(self, units: int) -> dict[str, Any]:
        """The checkpoint's record of a place ``units`` into the epoch."""
        kind, size = self.unit()
        return {
            "num_processes": self.num_processes,
            "units": int(units),
            "unit": kind,
            "unit_size": size,
        }

    def carried_units(self, record: dict[str, Any]) -> int | None:
        """The units of this loader's global order to leave out for a restored ``record``, or
        None when the per-process count applies as it is (the same process count, on a step
        boundary of this run's processes, or a record that cannot be carried over: warned).

        Raises:
            ConfigurationError: for a record that is not one of ours.
        """
        try:
            saved_processes = int(record["num_processes"])
            units = int(record["units"])
            kind = str(record["unit"])
            size = record.get("unit_size")
        except (KeyError, TypeError, ValueError):
            raise ConfigurationError(
                f"the dataloader state's {GLOBAL_POSITION!r} entry is {record!r}; expected a "
                "dict with 'num_processes', 'units', 'unit' and 'unit_size'. Load a checkpoint "
                "saved by accelkit."
            ) from None
        if saved_processes == self.num_processes and units % self.units_per_step == 0:
            return None
        my_kind, my_size = self.unit()
        if kind != my_kind or (size != my_size and (size is None or my_size is None)):
            _warn_position_lost(record, my_kind, my_size)
            return None
        if size == my_size or size is None:
            return units
        assert my_size is not None
        samples = units * int(size)
        if samples % my_size:
            _warn_position_rounded(samples, int(size), my_size)
        return samples // my_size

    def skip(self, units: int) -> None:
        """Leave out the first ``units`` of the global order in the next pass (0: none)."""
        if self.dispatch is not None:
            self.dispatch_skip = units
        elif self.shard is not None:
            self.shard.pass_skip_global = units
        elif self.iterable_shard is not None:
            self.iterable_shard.pass_skip_samples = units

    def skipped(self, main: Iterator[Any]) -> Iterator[Any]:
        """With dispatching, the main process's batches after the skip."""
        if not self.dispatch_skip:
            return main
        return itertools.islice(main, self.dispatch_skip, None)


class Shuffling:
    """The randomness that decides a pass's order: the generators' states as the pass starts,
    and the seed a one-process shuffle drew for it.

    Its record (``"randomness"`` in a saved position) is matched by role on restore, so that a
    position saved on another number of processes replays the same order: a multi-process run
    shuffles from one generator shared by every process, a one-process run from a seed drawn
    per pass. Saved with the shared generator and restored on one process, the sampler gets a
    generator with that state and shuffles from it from then on: the saving run's orders, every
    later epoch included. Saved with a drawn seed and restored on several processes, the shared
    generator starts a resumed pass from that seed: that pass's order (later epochs follow the
    shared generator, the same on every process).

    Args:
        recorded: the loader's recorded shuffle, if it has one.
        generator: the user's ``DataLoader(generator=...)``.
    """

    def __init__(self, recorded: RecordedRandomSampler | None, generator: Any) -> None:
        self.recorded = recorded
        self.generator: torch.Generator | None = generator

    def generators(self) -> list[torch.Generator]:
        """The generators whose states at the start of a pass decide its randomness."""
        found: list[torch.Generator] = []
        recorded = self.recorded
        for generator in (None if recorded is None else recorded.generator, self.generator):
            if generator is not None and all(generator is not g for g in found):
                found.append(generator)
        return found

    def record(self) -> dict[str, Any]:
        """The randomness a pass starting now would use (no seed drawn yet)."""
        recorded = self.recorded
        return {
            "generator_states": [g.get_state() for g in self.generators()],
            "sampler_seed": None,
            "sampler_generator": recorded is not None and recorded.generator is not None,
        }

    def restore(self, randomness: dict[str, Any] | None, resumed: bool) -> dict[str, Any]:
        """Put back the states ``randomness`` recorded (and, for a ``resumed`` pass, the seed
        it drew); return the record of the pass that starts now.

        Raises:
            ConfigurationError: for a saved state that is not a generator state.
        """
        recorded = self.recorded
        if randomness is not None:
            states: list[Any] = list(randomness["generator_states"])
            saved_shared = randomness.get("sampler_generator")  # None: an older checkpoint
            if recorded is not None and saved_shared is not None:
                if saved_shared and recorded.generator is None:
                    recorded.generator = torch.Generator()
                elif recorded.generator is not None and not saved_shared:
                    seed = randomness.get("sampler_seed")
                    replay = None  # None: the shared generator is left as it is
                    if resumed and seed is not None:
                        replay = torch.Generator().manual_seed(int(seed)).get_state()
                    states.insert(0, replay)
            for generator, saved in zip(self.generators(), states):
                if saved is not None:
                    generator.set_state(_generator_state(saved, generator))
            if resumed and recorded is not None and recorded.generator is None:
                recorded.replay_seed = randomness.get("sampler_seed")
        return self.record()


def _warn_position_lost(record: dict[str, Any], kind: str, size: int | None) -> None:
    warnings.warn(
        f"the dataloader position was saved as {record.get('units')} {record.get('unit')} of "
        f"{record.get('unit_size')} sample(s) on {record.get('num_processes')} process(es), "
        f"and this loader counts {kind} of {size} sample(s): the position cannot be carried "
        "over, so the saved per-process count is applied as it is and samples of the resumed "
        "epoch may be repeated or left out. Resume with the same dataloader (batch size, "
        f"batch sampler) on --num_processes {record.get('num_processes')} for an exact "
        "continuation.",
        stacklevel=5,
    )


def _warn_position_rounded(samples: int, saved_size: int, size: int) -> None:
    warnings.warn(
        f"the dataloader position is sample {samples} of the epoch (saved with batches of "
        f"{saved_size}), which is not a whole number of this loader's batches of {size}: the "
        f"resumed epoch starts at sample {samples - samples % size}, so {samples % size} "
        f"sample(s) are seen twice. Resume with batch_size={saved_size} for an exact "
        "continuation.",
        stacklevel=5,
    )


def _generator_state(saved: Any, generator: torch.Generator) -> torch.Tensor:
    """``saved`` as a state ``generator`` accepts (a compact copy: a checkpoint's tensors may be
    views into a mapped file).

    Raises:
        ValueError: if ``saved`` is not a generator state of the right size.
    """
    size = generator.get_state().numel()
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8 or saved.numel() != size:
        raise ConfigurationError(
            f"the dataloader state's generator state is {type(saved).__name__} "
            f"{getattr(saved, 'dtype', '')} {tuple(getattr(saved, 'shape', ()))}, expected a "
            f"uint8 tensor of {size} elements; load a checkpoint saved by the same script."
        )
    return saved.reshape(-1).clone()
