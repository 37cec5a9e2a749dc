"""The resume fingerprint: a record of what one process's next steps consume.

Each checkpoint holds one per process (``resume_fingerprint_<rank>.json``): named components,
each a short text (``"world size": "2"``, ``"dataloader 0 batch size": "8"``) or a digest of
something large (``"dataloader 0 data order"``: the sample indices of the next batches;
``"RNG stream torch"``: the torch generator's state). The first step after a resume computes
the same components and compares (:mod:`accelkit._accelerator.resume`); this module holds the
record's format and the parts of it this room knows: the digests and the random streams.

Public API:

- :data:`Fingerprint` -- the record: component name -> text.
- :func:`digest(value) <digest>` -- a short, stable digest of tensors, arrays, numbers,
  strings and nested lists, tuples and dicts of them.
- :func:`rng_components` -- ``"RNG stream python"``, ``"numpy"``, ``"torch"`` (and ``"cuda"``
  when CUDA is initialised): digests of the current global generator states.
- :func:`check_fingerprint(value, source) <check_fingerprint>` -- a record read from a
  checkpoint, refused if it is not one.
- :func:`differences(saved, now) <differences>` -- the components that differ, as
  :class:`Difference` (a component missing on one side differs too).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.objects.rng import capture_rng_state

__all__ = [
    "DIGEST_PREFIX",
    "Difference",
    "Fingerprint",
    "check_fingerprint",
    "differences",
    "digest",
    "rng_components",
]

Fingerprint = dict[str, str]
"""A resume fingerprint: component name -> a short text or a :func:`digest`."""

DIGEST_PREFIX = "sha256:"
"""How a digested component's text starts (its value is too large to show)."""

# A record is small (a few components per dataloader); anything larger was not written by us.
_MAX_COMPONENTS = 10_000
_MAX_TEXT = 1_000


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"tensor:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        hasher.update(f"array:{value.dtype}:{value.shape}:".encode())
        hasher.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        hasher.update(b"{")
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
            hasher.update(b",")
        hasher.update(b"]")
    else:
        hasher.update(f"{type(value).__name__}:{value!r};".encode())


def digest(value: Any) -> str:
    """A short, stable digest of ``value`` (:data:`DIGEST_PREFIX` and 16 hex digits).

    Equal tensors, arrays, numbers, strings, and lists, tuples and dicts of them give equal
    digests in every process and every run (a tensor's dtype and shape count, its device does
    not; an integer index and a tensor holding it differ).
    """
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return DIGEST_PREFIX + hasher.hexdigest()[:16]


def rng_components() -> Fingerprint:
    """``"RNG stream <name>"`` -> the digest of each global generator's current state (those
    a checkpoint's ``random_states_<rank>`` file saves)."""
    return {f"RNG stream {name}": digest(state) for name, state in capture_rng_state().items()}


def check_fingerprint(value: Any, source: str) -> Fingerprint:
    """``value`` as a :data:`Fingerprint`, read from the file ``source``.

    Raises:
        CorruptCheckpointError: it is not a mapping of short texts to short texts.
    """
    if (
        not isinstance(value, Mapping)
        or len(value) > _MAX_COMPONENTS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= _MAX_TEXT >= len(v)
            for k, v in value.items()
        )
    ):
        raise CorruptCheckpointError(
            f"{source}: expected a resume fingerprint (a JSON object of short strings); the "
            "file is damaged. Delete it to load the checkpoint without the resume check, or "
            "load another checkpoint."
        )
    return dict(value)


@dataclass(frozen=True)
class Difference:
    """One component that differs between the saved record and the resumed run.

    Attributes:
        component: its name (``"dataloader 0 batch size"``, ``"RNG stream torch"``).
        saved: its text in the checkpoint, ``None`` if the checkpoint has no such component.
        now: its text now, ``None`` if the resumed run has none.
    """

    component: str
    saved: str | None
    now: str | None

    def describe(self) -> str:
        """``"dataloader 0 batch size 8 -> 4"``, or ``"RNG stream torch differs"`` for digests,
        or which side lacks it."""
        if self.saved is None:
            return f"{self.component} is new (the saved run had none)"
        if self.now is None:
            return f"{self.component} is missing (the saved run had one)"
        if self.saved.startswith(DIGEST_PREFIX) or self.now.startswith(DIGEST_PREFIX):
            return f"{self.component} differs"
        return f"{self.component} {self.saved} -> {self.now}"


def differences(saved: Mapping[str, str], now: Mapping[str, str]) -> list[Difference]:
    """The components of ``saved`` and ``now`` whose texts differ, in ``saved``'s order then
    ``now``'s."""
    names = list(saved) + [name for name in now if name not in saved]
    return [
        Difference(name, saved.get(name), now.get(name))
        for name in names
        if saved.get(name) != now.get(name)
    ]
