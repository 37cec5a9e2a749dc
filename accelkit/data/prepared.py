"""The prepared dataloader classes: iteration, end detection, position and skipping.

:func:`accelkit.data.preparation.prepare_data_loader` builds these; this module holds what one
prepared loader does while it is iterated and how its position is saved, restored and skipped.

**Resuming.** A position restored by ``load_state_dict`` (what ``Accelerator.load_state`` calls)
is *pending*: the next pass of the loader, or of a loader that :meth:`skip_first_batches` made
from it, starts there, and only that pass. A loader from ``skip_first_batches(n)`` starts its
first pass at batch ``n`` of the epoch, in place of a pending position (never on top of it),
and its later passes are full epochs. So both resume idioms give the batches of an
uninterrupted run:

* ``load_state()`` then iterate the loader, every epoch;
* ``load_state()``, iterate ``skip_first_batches(loader, n)`` for the resumed epoch and the
  loader for the following ones (the Accelerate documents' idiom).

In the reference the skip is applied on every pass of the skipping loader, and with a stateful
dataloader the restored position also applies to the next pass of the original one, so the epoch
after the resumed one loses its first ``n`` batches; here neither happens.

**Another number of processes.** A saved position also records where the epoch is in its
*global* order (``"global_position"``: how many batches of the user's batch sampler, or samples
of an iterable dataset, every process together has consumed, and on how many processes). A
loader restored on another number of processes starts its next pass there, before the batches
are dealt to the processes, so every sample of the epoch is seen exactly once and in the saving
run's global order; the shuffling generator is matched by its role (the shared generator of a
multi-process run, or the per-pass seed of a one-process run), so the resumed epoch's order is
the interrupted one's. A position without that record (an older checkpoint) is per process and
is applied as it is (the checkpoint reader warns when the process count differs).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from accelkit.data.dispatch import Dispatch, dispatched_batches
from accelkit.data.position import GLOBAL_POSITION, GlobalOrder, Shuffling
from accelkit.data.random_streams import RandomStreams, tags_workers
from accelkit.data.sampling import (
    BatchSamplerShard,
    IterableDatasetShard,
    RecordedRandomSampler,
    SeedableRandomSampler,
)
from accelkit.errors import DependencyError
from accelkit.runtime import ops
from accelkit.runtime.preemption import spare_child_processes
from accelkit.training.optim import GradientState

__all__ = [
    "PreparedDataLoader",
    "PreparedLoaderMixin",
    "Recipe",
    "build",
    "is_prepared",
    "is_stateful",
]

_STATEFUL_MODULE = "torchdata.stateful_dataloader"


@dataclasses.dataclass
class Recipe:
    """Everything needed to build a prepared loader (again: ``skip_first_batches`` clones).

    A plain dataclass of picklable parts, so prepared loaders (and an ``Accelerator`` holding
    them) can be pickled.
    """

    stateful: bool
    dataset: Any
    loader_kwargs: dict[str, Any]
    gradient_state: GradientState
    device: torch.device | None
    non_blocking: bool
    shard: BatchSamplerShard | None = None
    iterable_shard: IterableDatasetShard | None = None
    unbatched: bool = False  # batch_size=None: the shard deals single items
    sampler_batches: bool = False  # batch_size=None with a BatchSampler as ``sampler``
    batch_size: int | None = None
    drop_last: bool = False
    random_sampler: SeedableRandomSampler | None = None
    recorded_sampler: RecordedRandomSampler | None = None
    remainder: int = -1
    total_batch_size: int | None = None
    total_dataset_length: int | None = None
    # dispatch_batches: how the main process reads (the user's own batching) and dispatches.
    dispatch: Dispatch | None = None
    dispatch_batching: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Position:
    """Where a loader is in its data; shared with the loaders ``skip_first_batches`` makes.

    ``pending_*`` hold a position restored by ``load_state_dict`` until the next pass (of any
    loader sharing this position) starts there.
    """

    __slots__ = (
        "base_units",
        "base_yielded",
        "end",
        "epoch",
        "offset",
        "pending",
        "pending_global",
        "pending_inner",
        "pending_offset",
        "pending_randomness",
        "randomness",
        "restored",
        "snapshot",
        "streams",
        "yielded",
    )

    def __init__(self) -> None:
        self.epoch = 0
        self.yielded = 0
        self.end = False
        self.snapshot: dict[str, Any] | None = None  # StatefulDataLoader state at `yielded`
        self.offset = 0  # batches the sampler left out before the StatefulDataLoader counted
        self.restored = False
        self.pending = 0
        self.pending_inner: dict[str, Any] | None = None
        self.pending_offset = 0
        # The shuffling randomness of the current pass as it was when the pass started.
        self.randomness: dict[str, Any] | None = None
        self.pending_randomness: dict[str, Any] | None = None
        # The restored global record (None: none, or an older checkpoint's per-process count).
        self.pending_global: dict[str, Any] | None = None
        # The random numbers the reads draw, and the restored ones (random_streams.py).
        self.streams = RandomStreams()
        # Where the current pass started in the epoch's global order (units of the global
        # record) and the value of ``yielded`` then: the global position is computed from them.
        self.base_units = 0
        self.base_yielded = 0

    def load_torchdata(self, state_dict: dict[str, Any]) -> None:
        """Resume from a ``StatefulDataLoader`` state (the epoch is kept: it holds none)."""
        self.restored = True
        self.pending = self.yielded = _torchdata_yielded(state_dict)
        self.end = False
        self.pending_inner = self.snapshot = dict(state_dict)
        self.pending_offset = self.offset = 0
        self.pending_randomness = None
        self.pending_global = None
        self.streams.pending = (None, None)

    def restore(self, state_dict: dict[str, Any], stateful: bool) -> None:
        """Resume from a prepared loader's ``state_dict()`` (checked before anything changes).

        Raises:
            KeyError: naming the missing entry when ``state_dict`` is not one of ours.
            ValueError: naming a malformed random-stream entry.
        """
        for key in ("epoch", "batches_yielded"):
            if key not in state_dict:
                raise KeyError(
                    f"dataloader state has no {key!r} entry (keys: {sorted(state_dict)}); pass "
                    "a dict produced by a prepared dataloader's state_dict()."
                )
        self.streams.pending = RandomStreams.checked(state_dict)
        self.epoch = int(state_dict["epoch"])
        self.restored = True
        self.pending = self.yielded = max(0, int(state_dict["batches_yielded"]))
        self.end = False
        inner = state_dict.get("stateful_dataloader") if stateful else None
        self.pending_inner = self.snapshot = inner
        self.pending_offset = self.offset = int(state_dict.get("sampler_offset") or 0)
        self.pending_randomness = state_dict.get("randomness")
        carried = state_dict.get(GLOBAL_POSITION)
        self.pending_global = dict(carried) if isinstance(carried, dict) else None

    def start_pass(self, yielded: int, units: int) -> None:
        """The pass starts ``yielded`` batches of this process, ``units`` of the global order,
        into its epoch."""
        self.yielded = self.base_yielded = yielded
        self.base_units = units

    def units(self, per_step: int) -> int:
        """Where the pass is in its epoch's global order (``per_step`` units per batch)."""
        return self.base_units + (self.yielded - self.base_yielded) * per_step

    def take_pending(
        self,
    ) -> tuple[bool, int, dict[str, Any] | None, int, dict[str, Any] | None, dict[str, Any] | None]:
        out = (
            self.restored,
            self.pending,
            self.pending_inner,
            self.pending_offset,
            self.pending_randomness,
            self.pending_global,
        )
        self.restored, self.pending, self.pending_inner, self.pending_offset = False, 0, None, 0
        self.pending_randomness = None
        self.pending_global = None
        return out


def build(recipe: Recipe, skip: int | None = None) -> Any:
    """A prepared loader from ``recipe``; ``skip``: its first pass starts at batch ``skip``."""
    cls: type = _stateful_class() if recipe.stateful else PreparedDataLoader
    kwargs = dict(recipe.loader_kwargs)
    shard = copy.copy(recipe.shard)  # own copy: the per-pass skip is set on it
    if recipe.dispatch is not None:
        loader = cls(recipe.dataset, **recipe.dispatch_batching, **kwargs)
    elif recipe.iterable_shard is not None:
        loader = cls(
            recipe.iterable_shard,
            batch_size=recipe.batch_size,
            drop_last=recipe.drop_last,
            **kwargs,
        )
    elif recipe.unbatched:
        assert shard is not None
        loader = cls(recipe.dataset, batch_size=None, sampler=_Unbatch(shard), **kwargs)
    elif recipe.sampler_batches:  # the dataset takes a list of indices per item
        loader = cls(recipe.dataset, batch_size=None, sampler=shard, **kwargs)
    else:
        loader = cls(recipe.dataset, batch_sampler=shard, **kwargs)
    loader._setup(recipe, shard, skip)
    return loader


class _Unbatch(torch.utils.data.Sampler[int]):
    """Indices from a shard of one-index batches (for loaders with ``batch_size=None``)."""

    def __init__(self, shard: BatchSamplerShard) -> None:
        self.shard = shard

    def __iter__(self) -> Iterator[int]:
        for batch in self.shard:
            yield batch[0]

    def __len__(self) -> int:
        return len(self.shard)


_END = object()


class PreparedLoaderMixin:
    """The behaviour shared by the plain and the stateful prepared dataloader."""

    # Set by _setup; declared for type checkers.
    gradient_state: GradientState
    device: torch.device | None
    remainder: int

    def _setup(self, recipe: Recipe, shard: BatchSamplerShard | None, skip: int | None) -> None:
        self._recipe = recipe
        self.gradient_state = recipe.gradient_state
        self.device = recipe.device
        self.non_blocking = recipe.non_blocking
        self._shard = shard
        self._iterable_shard = recipe.iterable_shard
        self._random_sampler = recipe.random_sampler
        self.remainder = recipe.remainder
        self.total_batch_size = recipe.total_batch_size
        self.total_dataset_length = recipe.total_dataset_length
        self._stateful = recipe.stateful
        self._pos = _Position()
        self._skip = skip  # skip_first_batches(n): the first pass starts at batch n
        self._len_skip = skip or 0  # what len() leaves out until that pass is over
        self._premade = False  # premake_iterator made the first pass's iterator
        # Workers reading a map-style dataset send their generator states (random_streams.py).
        self._tags = shard is not None and recipe.dispatch is None and tags_workers(self)
        self._drawn = False  # that iterator's draw stands for this loader's first pass
        self._shuffling = Shuffling(recipe.recorded_sampler, recipe.loader_kwargs.get("generator"))
        self._order = GlobalOrder(
            recipe.dispatch, shard, recipe.iterable_shard, recipe.dispatch_batching
        )
        # The device copy is decided once here, not per batch.
        self._on_device = device_is_remote(recipe.device)

    def _move(self, batch: Any) -> Any:
        assert self.device is not None
        return ops.send_to_device(batch, self.device, self.non_blocking)

    # ---------------------------------------------------------------- epochs

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the current pass is in use."""
        return self._pos.end

    @property
    def epoch(self) -> int:
        """The epoch whose order the next (or current) pass uses; +1 after each full pass."""
        return self._pos.epoch

    @property
    def iteration(self) -> int:
        """The reference's name for :attr:`epoch`."""
        return self._pos.epoch

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether this loader is built on torchdata's ``StatefulDataLoader``."""
        return bool(self._stateful)

    @property
    def base_dataloader(self) -> Any:
        """The loader that reads the data: this object itself (Accelerate's adapters wrap one;
        a prepared loader *is* its ``DataLoader`` or ``StatefulDataLoader``)."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffling order (and dataset epoch) of ``epoch`` from the next pass on.

        A batch sampler of the user's that has ``set_epoch``, and its ``sampler`` if that has
        one (a ``DistributedSampler``, say), are told at once, and again as each pass starts,
        as Accelerate tells them.
        """
        self._pos.epoch = int(epoch)
        self._tell_user_samplers(self._pos.epoch)

    def _tell_user_samplers(self, epoch: int) -> None:
        """Call ``set_epoch(epoch)`` on the user's batch sampler and its inner sampler."""
        batch_sampler: Any
        if self._shard is not None:
            batch_sampler = self._shard.batch_sampler
        else:  # dispatch_batches: the main process batches with the user's batch sampler
            batch_sampler = self._recipe.dispatch_batching.get("batch_sampler")
        told: list[Any] = []
        for sampler in (batch_sampler, getattr(batch_sampler, "sampler", None)):
            # accelkit's own seedable sampler is set in _begin; each object is told once.
            if sampler is None or sampler is self._random_sampler:
                continue
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch) and all(sampler is not seen for seen in told):
                set_epoch(epoch)
                told.append(sampler)

    def __len__(self) -> int:
        """Batches of a full pass; for a ``skip_first_batches`` loader, until its skipped pass
        is over, the batches left after the skip."""
        length: int = super().__len__()  # type: ignore[misc]
        if self._recipe.dispatch is not None:
            length = self._recipe.dispatch.length(length)
        return max(0, length - self._len_skip)

    def _begin(self) -> tuple[int, bool]:
        """Prepare a pass; return how many batches ``__iter__`` must read and drop, and whether
        the pass resumes one that a checkpoint interrupted (its random draws were made then)."""
        pos = self._pos
        if self._random_sampler is not None:
            self._random_sampler.set_epoch(pos.epoch)
        self._tell_user_samplers(pos.epoch)
        if self._iterable_shard is not None:
            self._iterable_shard.set_epoch(pos.epoch)
        elif self._recipe.dispatch is not None and hasattr(self._recipe.dataset, "set_epoch"):
            self._recipe.dataset.set_epoch(pos.epoch)
        restored, pending, inner, offset, randomness, carried = pos.take_pending()
        order = self._order
        # units: where the pass starts in the epoch's global order, when the restored position
        # was saved on another number of processes (None: the per-process count applies).
        units = None if carried is None else order.carried_units(carried)
        resumed = restored and (pending > 0 if units is None else units > 0)
        if restored or pos.epoch != 0 or self._skip:
            self._drop_premade()
        self._premade = False
        pos.randomness = self._shuffling.restore(randomness, resumed)
        explicit, self._skip = self._skip, None
        self._len_skip = explicit or 0
        per_step = order.units_per_step
        skip = pending
        if explicit is not None:
            # skip_first_batches with the restored count (of the saving run's processes, or
            # converted to this run's) is the restored position, wherever it is.
            same = units is not None and explicit in (pending, units // per_step)
            if not same:
                if restored and explicit != pending:
                    _warn_skip_mismatch(explicit, pending, pos.epoch)
                if explicit != pending:
                    inner, offset = None, 0  # the saved StatefulDataLoader state is another place
                skip, units = explicit, None
        pos.end = False
        self.remainder = self._recipe.remainder
        order.skip(units or 0)
        pos.streams.start_pass(resumes=resumed and units is None and skip == pending)
        if units is not None:
            # Another process count: the saved StatefulDataLoader state is one process's share
            # of another division; the samplers start the pass at the global position instead.
            pos.start_pass(units // per_step, units)
            pos.offset = pos.yielded if self._stateful else 0
            if self._shard is not None:
                self._shard.pass_skip = 0
            return 0, resumed
        pos.start_pass(skip, skip * per_step)
        drop = 0
        sampler_skip = 0
        if self._stateful and inner is not None and resumed:
            # The StatefulDataLoader fast-forwards itself, after the sampler's own skip. (A
            # state saved on an epoch's last batch is not loaded: the next epoch starts afresh,
            # drawing what an uninterrupted run draws.)
            super().load_state_dict(inner)  # type: ignore[misc]
            sampler_skip = offset
        elif self._shard is not None:  # skip indices, without loading the samples
            sampler_skip = skip
        else:  # an iterable dataset: read and drop
            drop = skip
        pos.offset = sampler_skip if self._stateful else 0
        if self._shard is not None:
            self._shard.pass_skip = sampler_skip
        return drop, resumed

    def premake_iterator(self) -> None:
        """Make the first pass's ``StatefulDataLoader`` iterator now (``prepare`` calls this
        with ``use_stateful_dataloader=True``).

        Making it draws the workers' base seed from the global torch RNG (without a loader
        generator). Accelerate makes it when the loader is prepared (it asks the new loader for
        its ``state_dict``), so the first epoch's shuffle and every later random number
        (dropout) depend on that draw's place in the RNG stream: doing the same here gives the
        same results as Accelerate for the same script. The iterator serves only a first pass
        that starts at the beginning of epoch 0 with nothing restored; any other pass makes its
        own (a resumed pass without drawing, see ``_new_iterator``).
        """
        if self._stateful:
            super().state_dict()  # type: ignore[misc]
            self._premade = True

    def _drop_premade(self) -> None:
        """Forget the iterator :meth:`premake_iterator` made (its draw stays made)."""
        if getattr(self, "_premade", False):
            self._premade = False
            self._iterator = None
            self._initial_iter_for_state_dict = False

    def _get_iterator(self) -> Any:
        # Where DataLoader starts its worker processes: with preemption signals watched, they
        # start with those signals blocked, so a signal sent to the whole job (SLURM without
        # B:) cannot kill a spawned worker before the training process saves.
        # Workers that send their generator states start with the hooks that do it.
        with spare_child_processes(), self._pos.streams.worker_hooks(self, self._tags):
            return super()._get_iterator()  # type: ignore[misc]

    def _new_iterator(self, resumed: bool) -> Iterator[Any]:
        # Making an iterator draws the workers' base seed from the loader's generator, or from
        # the global torch RNG when it has none (as PyTorch and the reference do). A resumed
        # pass made that draw before the checkpoint, whose RNG state is restored, so drawing
        # again would shift every later random number (dropout...): draw from a throwaway
        # generator instead. (With workers, their seeds then differ from the interrupted pass.)
        # The same holds for a skip_first_batches loader whose original's premade iterator
        # made the draw of this pass.
        if not resumed or self._recipe.loader_kwargs.get("generator") is not None:
            return super().__iter__()  # type: ignore[misc]
        self.generator: torch.Generator | None = torch.Generator()
        try:
            return super().__iter__()  # type: ignore[misc]
        finally:
            self.generator = None

    def __iter__(self) -> Iterator[Any]:
        state = self.gradient_state
        # A step boundary before the pass starts (nothing drawn yet), and one each time the
        # next batch is asked for: the state there is the state after the previous loop body
        # (see accelkit.training.boundary).
        on_boundary = state.on_boundary
        if on_boundary.hooks:
            on_boundary("batch", self)
        drop, resumed = self._begin()
        pos = self._pos
        state.enter_loader(self)
        try:
            drawn, self._drawn = self._drawn, False
            it = self._new_iterator(resumed or drawn)
            if self._recipe.dispatch is not None:
                it = self._dispatch(it)
            if self._tags:
                it = pos.streams.untagged(it, self.num_workers)  # type: ignore[attr-defined]
            read_next = functools.partial(next, it, _END)
            current = pos.streams.first_read(read_next, drop, _END)
            recorded = self._recipe.recorded_sampler
            if recorded is not None and pos.randomness is not None:
                pos.randomness["sampler_seed"] = recorded.last_seed
            move = self._move if self._on_device else None
            watch = pos.streams.read_ahead
            if current is not _END and move is not None:
                current = move(current)
            while current is not _END:
                snapshot = self._inner_state() if self._stateful else None
                if watch.drawn or not watch.countdown:
                    upcoming = watch.read(read_next)
                else:  # a read that draws nothing and is not a probe (see readahead.py)
                    watch.countdown -= 1
                    upcoming = next(it, _END)
                if upcoming is _END:
                    self._mark_end()
                else:
                    pos.snapshot = snapshot
                    if move is not None:
                        upcoming = move(upcoming)
                pos.yielded += 1
                yield current
                if on_boundary.hooks:
                    # After the last batch the loop body's next code is the script's, not
                    # another batch: "end" (the next pass's start is the next batch).
                    on_boundary("batch" if upcoming is not _END else "end", self)
                current = upcoming
            pos.epoch += 1
            pos.start_pass(0, 0)
            pos.end = False
            self._len_skip = 0
        finally:
            state.exit_loader(self)

    def _dispatch(self, base: Iterator[Any]) -> Iterator[Any]:
        """This process's slices of the batches the main process reads from ``base`` (made on
        every process, as the reference does, so that every process draws the same seeds)."""
        dispatch = self._recipe.dispatch
        assert dispatch is not None

        def on_round(size: int) -> None:
            self.remainder = size

        main = base if dispatch.process_index == 0 else None
        if main is not None:
            main = self._order.skipped(main)
        return dispatched_batches(main, dispatch, on_round)

    def _mark_end(self) -> None:
        self._pos.end = True
        shard = self._iterable_shard
        if (
            shard is not None
            and shard.last_remainder >= 0
            and self.total_batch_size is not None
            and getattr(self, "num_workers", 0) == 0
        ):
            self.remainder = shard.last_remainder
        if self._stateful:
            self._pos.snapshot = self._inner_state()
            self._pos.offset = 0

    def _inner_state(self) -> dict[str, Any]:
        return dict(super().state_dict())  # type: ignore[misc]

    # ------------------------------------------------------------- position

    def state_dict(self) -> dict[str, Any]:
        """This process's position: epoch, batches yielded, shuffling seed and the shuffling
        randomness (``"randomness"``): mid-epoch, the generator states at the start of the
        epoch and the seed a non-seedable sampler drew, so that a resume replays the epoch;
        between epochs, the generator states the next epoch starts from.

        Saved while the last batch of an epoch is in use, it points at the start of the next
        epoch. With ``use_stateful_dataloader`` it also holds the ``StatefulDataLoader`` state
        (under ``"stateful_dataloader"``; None before the first batch) and how many batches the
        sampler skipped before that state started counting (``"sampler_offset"``).

        ``"global_position"`` records the same place in the epoch's global order, for a resume
        on another number of processes: ``num_processes`` (of this run), ``units`` (what every
        process together has consumed of the epoch), ``unit`` (``"batches"`` of the user's
        batch sampler, or ``"samples"`` of an iterable dataset) and ``unit_size`` (samples per
        unit; None when batches vary in size).

        ``"read_ahead_rng"`` and ``"worker_rng"`` (mid-epoch, when the reads draw random
        numbers, in this process or in the loader's workers): the generator states a resumed
        pass reads from to draw what the saved one drew (:mod:`accelkit.data.random_streams`).
        """
        pos = self._pos
        out: dict[str, Any] = {
            "epoch": pos.epoch + 1 if pos.end else pos.epoch,
            "batches_yielded": 0 if pos.end else pos.yielded,
            "seed": None if self._random_sampler is None else self._random_sampler.seed,
        }
        if not pos.restored:
            units = 0 if pos.end else pos.units(self._order.units_per_step)
            out[GLOBAL_POSITION] = self._order.record(units)
        elif pos.pending_global is not None:  # not iterated since the load: as it was saved
            out[GLOBAL_POSITION] = dict(pos.pending_global)
        if pos.restored:
            randomness = pos.pending_randomness
        elif not pos.end and (pos.yielded > 0 or pos.base_units > 0):  # to replay the epoch
            randomness = pos.randomness
        else:  # between epochs: where the next epoch's draws start
            randomness = self._shuffling.record()
        if randomness and (
            randomness["generator_states"] or randomness["sampler_seed"] is not None
        ):
            out["randomness"] = randomness
        if not pos.end and pos.yielded > 0:
            out.update(pos.streams.record(pos.restored))
        if self._stateful:
            out["stateful_dataloader"] = pos.snapshot
            out["sampler_offset"] = 0 if pos.end else pos.offset
        if self._premade or self._drawn:
            # The next pass is the first, and its iterator's draw was made at prepare() (see
            # premake_iterator): the draw is in the RNG states saved beside this, so a
            # resumed run must not draw again when that pass starts.
            out["first_pass_drawn"] = True
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the position ``state_dict`` describes, on the next pass (only).

        A loader built on ``StatefulDataLoader`` also takes that class's own ``state_dict()``
        (what Accelerate's stateful loaders save): the next pass continues where it stopped.

        Raises:
            KeyError: naming the missing entry when ``state_dict`` is not one of ours.
            ValueError: naming ``read_ahead_rng`` or ``worker_rng`` when their generator
                states are malformed (nothing is restored then).
        """
        # A restored pass makes its own iterator (the checkpoint's RNG states decide its draws).
        self._drop_premade()
        self._drawn = bool(isinstance(state_dict, dict) and state_dict.get("first_pass_drawn"))
        if self._stateful and _is_torchdata_state(state_dict):
            self._pos.load_torchdata(state_dict)
            return
        self._pos.restore(state_dict, self._stateful)
        seed = state_dict.get("seed")
        if seed is not None and self._random_sampler is not None:
            self._random_sampler.seed = int(seed)

    # ------------------------------------------------------------- skipping

    def skip_first_batches(self, num_batches: int) -> Any:
        """A new prepared loader over the same data whose first pass leaves out the first
        ``num_batches`` batches of the epoch.

        It shares this loader's position: its progress shows in this loader's ``state_dict()``
        and its full pass advances this loader's epoch. Its first pass replaces a position
        restored by ``load_state_dict`` (it does not skip on top of it); its later passes are
        full epochs.
        """
        clone = build(self._recipe, num_batches)
        clone._pos = self._pos
        if self._premade:  # the first pass is the clone's: it must not draw a second time
            self._drop_premade()
            clone._drawn = self._pos.epoch == 0
        return clone

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _rebuild_pickled, (self._recipe, self._pos, self._skip, self._len_skip)


def _is_torchdata_state(state_dict: Any) -> bool:
    """Whether ``state_dict`` is a torchdata ``StatefulDataLoader``'s own state."""
    return (
        isinstance(state_dict, dict)
        and "batches_yielded" not in state_dict
        and ("_num_yielded" in state_dict or "_snapshot" in state_dict)
    )


def _torchdata_yielded(state_dict: dict[str, Any]) -> int:
    """Batches a ``StatefulDataLoader`` state says were yielded in its pass (0 if unknown)."""
    if "_num_yielded" in state_dict:
        return max(0, int(state_dict["_num_yielded"]))
    snapshot = state_dict.get("_snapshot") or {}
    main = snapshot.get("_main_snapshot") or {}
    steps = int(state_dict.get("_steps_since_snapshot") or 0)
    return max(0, int(main.get("_num_yielded") or 0) + steps)


def _warn_skip_mismatch(explicit: int, pending: int, epoch: int) -> None:
    warnings.warn(
        f"skip_first_batches(num_batches={explicit}) on a dataloader whose position load_state "
        f"restored to batch {pending} of epoch {epoch}: this pass starts at batch {explicit}, "
        f"as asked. To resume where the checkpoint stopped, pass num_batches={pending}, or "
        "iterate the dataloader itself (it resumes on its own after load_state).",
        stacklevel=4,
    )


def _rebuild_pickled(
    recipe: Recipe, pos: _Position, skip: int | None, len_skip: int
) -> PreparedLoaderMixin:
    loader = build(recipe, skip)
    loader._pos = pos
    loader._len_skip = len_skip
    return loader


def device_is_remote(device: torch.device | None) -> bool:
    """Whether batches must be copied to ``device`` (anything but None or the CPU)."""
    return device is not None and device.type != "cpu"


class PreparedDataLoader(PreparedLoaderMixin, DataLoader[Any]):  # type: ignore[misc]
    """A ``DataLoader`` made by :func:`~accelkit.data.preparation.prepare_data_loader`.

    Extra attributes: ``device``, ``epoch``, ``end_of_dataloader``, ``remainder`` (real samples
    in the last global batch; -1 when unknown), ``total_batch_size`` (samples per step across
    processes), ``total_dataset_length``.
    """


_STATEFUL_CLASS: type | None = None


def _stateful_class() -> type:
    global _STATEFUL_CLASS
    if _STATEFUL_CLASS is None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            raise DependencyError(
                "use_stateful_dataloader=True needs torchdata: pip install 'torchdata>=0.8'"
            ) from None
        _STATEFUL_CLASS = type(
            "PreparedStatefulDataLoader",
            (PreparedLoaderMixin, StatefulDataLoader),
            {
                "__doc__": "A prepared dataloader built on torchdata's ``StatefulDataLoader``.",
                "__module__": __name__,
            },
        )
    return _STATEFUL_CLASS


def __getattr__(name: str) -> Any:
    # Built on first use, so that importing accelkit does not import torchdata.
    if name == "PreparedStatefulDataLoader":
        return _stateful_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_prepared(loader: Any) -> bool:
    """Whether ``loader`` is a prepared dataloader (plain or stateful)."""
    return isinstance(loader, PreparedLoaderMixin)


def is_stateful(loader: Any) -> bool:
    """Whether ``loader`` is a torchdata ``StatefulDataLoader`` (without importing torchdata)."""
    module = sys.modules.get(_STATEFUL_MODULE)
    return module is not None and isinstance(loader, module.StatefulDataLoader)
