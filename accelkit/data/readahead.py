"""The random numbers a prepared loader's read-ahead draws, kept so that a resume draws them again.

A prepared loader reads each batch one step early (to know which batch is an epoch's last,
``end_of_dataloader``). With ``num_workers=0`` the samples are read in the training process, so
a dataset that draws random numbers as it reads a sample (an augmentation, a random crop, from
Python's, NumPy's or torch's global generator) draws them *before* the previous training step
(dropout...). A checkpoint saved mid-epoch therefore records generator states that already
include the next batch's draws, and a resume that reads that batch again from those states
draws other numbers: the augmentation and every later random number differ from the
uninterrupted run. (Accelerate has the same read-ahead and resumes differently, silently.)

:class:`ReadAheadRandomness` keeps the global generator states from just before each read-ahead
read; the loader saves them with its position (``"read_ahead_rng"``) and a resumed pass reads
its first batch under them, then puts the restored states back, so the run goes on bit for bit.

Which generators to keep is learnt by watching, over the loader's life: its first read-ahead
keeps all three states and compares cheap marks of them before and after (about 90 us); its
reads 1, 2, 4, ..., :data:`PROBE_EVERY`, and every :data:`PROBE_EVERY`-th after, compare the
marks again (about 25 us). The other reads keep only the generators seen drawn (torch's costs
2 us, Python's 10, NumPy's 50). Reads that draw nothing (loader workers, or a dataset without
randomness) keep nothing. A generator first drawn after the first read is kept from the read
after the probe that saw it: a save between its first draw and then is not exact for it.

With loader workers, the samples are read (and their random numbers drawn) in the workers,
each seeded per pass; that is not covered here.

Public API: :class:`ReadAheadRandomness`, :func:`read_under`, :data:`PROBE_EVERY`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from accelkit.runtime.random import (
    drawn_generators,
    generator_marks,
    global_generator_states,
    set_global_generator_states,
)

__all__ = ["PROBE_EVERY", "ReadAheadRandomness", "read_under"]

PROBE_EVERY = 1024
"""After the first read-ahead of a pass, the generators are compared again on reads 1, 2, 4, ...
up to this many, then on every this many."""

T = TypeVar("T")


class ReadAheadRandomness:
    """The global generator states the latest read-ahead read started from (None: it drew
    nothing), learning which generators the loader's reads draw from.

    The loader calls :meth:`read` for a read while :attr:`drawn` is not empty or
    :attr:`countdown` is 0, and otherwise reads itself and takes one off :attr:`countdown` (the
    reads until the next probe), so that a pass drawing nothing pays an attribute test a read.
    """

    __slots__ = ("_next_probe", "countdown", "drawn", "held")

    def __init__(self) -> None:
        self.held: dict[str, Any] | None = None
        self.drawn: frozenset[str] = frozenset()
        self.countdown = 0
        self._next_probe = 0

    def start_pass(self) -> None:
        """A new pass: nothing is held yet. (What the reads draw from is learnt across passes:
        the probes go on where the last pass left them.)"""
        self.held = None

    def read(self, read: Callable[[], T]) -> T:
        """``read()``, keeping the states it started from in :attr:`held`."""
        if self.countdown:  # not a probe: keep the generators seen drawn
            self.countdown -= 1
            self.held = global_generator_states(self.drawn) if self.drawn else None
            return read()
        at = self._next_probe
        self._next_probe = 1 if at == 0 else at * 2 if at < PROBE_EVERY else at + PROBE_EVERY
        self.countdown = self._next_probe - at - 1
        if at == 0:  # the loader's first read-ahead: every generator, compared by its marks
            states = global_generator_states()
            marks = generator_marks()
            item = read()
            self.drawn = frozenset(drawn_generators(marks, generator_marks()))
            self.held = {name: states[name] for name in self.drawn} or None
            return item
        # A later probe: a generator first drawn here is kept from the next read on.
        self.held = global_generator_states(self.drawn) if self.drawn else None
        marks = generator_marks()
        item = read()
        self.drawn |= drawn_generators(marks, generator_marks())
        return item


def read_under(
    states: Mapping[str, Any], read: Callable[[], T], after: Mapping[str, Any] | None = None
) -> T:
    """``read()`` with the global generators set to ``states``; the generators are then put
    back as they were (or set to ``after``), so the read draws what the saved run's read drew
    and nothing else moves."""
    kept = global_generator_states(states.keys()) if after is None else after
    set_global_generator_states(states)
    try:
        return read()
    finally:
        set_global_generator_states(kept)
