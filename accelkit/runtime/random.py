"""Seeding every random number generator a training script touches, and keeping them in step
across processes."""

from __future__ import annotations

import ctypes
import enum
import os
import random as _py_random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from accelkit.errors import ConfigurationError, WrongTypeError

__all__ = [
    "GLOBAL_GENERATORS",
    "RNGType",
    "checked_generator_states",
    "drawn_generators",
    "generator_marks",
    "global_generator_states",
    "set_global_generator_states",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
]

GLOBAL_GENERATORS = ("python", "numpy", "torch")
"""The process-wide generators a dataset or a transform draws from without being given one:
Python's ``random``, NumPy's legacy ``np.random`` and torch's CPU generator."""


class RNGType(str, enum.Enum):
    """Random number generators :func:`synchronize_rng_states` can align (the reference's names).

    accelkit synchronises ``TORCH``, ``CUDA`` and ``GENERATOR``; the others belong to devices it
    does not drive and are refused when requested on a machine without them.
    """

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


def _rng_type(value: str | RNGType) -> RNGType:
    try:
        return RNGType(value)
    except ValueError:
        accepted = ", ".join(repr(t.value) for t in RNGType)
        raise ConfigurationError(
            f"Unknown rng type {value!r}. Expected one of {accepted}."
        ) from None


def synchronize_rng_state(
    rng_type: RNGType | str | None = None, generator: torch.Generator | None = None
) -> None:
    """Copy the main process's state of one generator to every process (a no-op on one).

    Args:
        rng_type: ``"torch"`` (the default CPU generator), ``"cuda"`` (this process's CUDA
            device) or ``"generator"`` (``generator``).
        generator: the generator for ``rng_type="generator"``.

    Raises:
        ValueError: for ``"generator"`` without a generator, or a device type accelkit does not
            drive (``"xla"``, ``"npu"``, ...).
    """
    kind = _rng_type(rng_type or RNGType.TORCH)
    if kind is RNGType.GENERATOR and generator is None:
        raise ConfigurationError(
            "synchronize_rng_state('generator') needs generator=<torch.Generator>."
        )
    if kind not in (RNGType.TORCH, RNGType.CUDA, RNGType.GENERATOR):
        raise ConfigurationError(
            f"accelkit cannot synchronise the {kind.value!r} generator: that device is not "
            "supported. Use 'torch', 'cuda' or 'generator'."
        )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if kind is RNGType.TORCH:
        state = torch.get_rng_state()
    elif kind is RNGType.CUDA:
        state = torch.cuda.get_rng_state()
    else:
        assert generator is not None
        state = generator.get_state()
    on_cuda = dist.get_backend() == "nccl"
    buffer = state.to("cuda") if on_cuda else state.clone()
    dist.broadcast(buffer, src=0)
    state = buffer.cpu()
    if kind is RNGType.TORCH:
        torch.set_rng_state(state)
    elif kind is RNGType.CUDA:
        torch.cuda.set_rng_state(state)
    else:
        assert generator is not None
        generator.set_state(state)


def synchronize_rng_states(
    rng_types: list[str | RNGType], generator: torch.Generator | None = None
) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``.

    Example:
        >>> synchronize_rng_states(["torch"])  # every process now draws the same numbers
    """
    for rng_type in rng_types:
        synchronize_rng_state(_rng_type(rng_type), generator=generator)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy, and torch (CPU and every CUDA device).

    Args:
        seed: the seed.
        device_specific: add this process's rank (``RANK``, 0 on one process) to the seed, so
            that processes draw different numbers (e.g. different augmentations). Shuffling of
            prepared dataloaders stays synchronised either way: it uses the main process's seed.
        deterministic: also ask torch for deterministic algorithms
            (``torch.use_deterministic_algorithms(True)``), which may be slower.

    Raises:
        TypeError: if ``seed`` is not an integer.

    Example:
        >>> set_seed(42)
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise WrongTypeError(
            f"set_seed expects an integer seed, got {seed!r} ({type(seed).__name__})."
        )
    seed = int(seed)
    if device_specific:
        seed += int(os.environ.get("RANK", "0") or 0)
    _py_random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def global_generator_states(names: Iterable[str] = GLOBAL_GENERATORS) -> dict[str, Any]:
    """The states of the global generators ``names`` (of :data:`GLOBAL_GENERATORS`), to put
    back with :func:`set_global_generator_states`.

    Capturing costs about 2 us for torch's, 10 us for Python's and 50 us for NumPy's, so a
    per-batch caller asks only for those it needs.
    """
    states: dict[str, Any] = {}
    for name in names:
        if name == "python":
            states[name] = _py_random.getstate()
        elif name == "numpy":
            states[name] = np.random.get_state()
        elif name == "torch":
            states[name] = torch.get_rng_state()
        else:
            raise ConfigurationError(
                f"unknown global generator {name!r}; expected one of {GLOBAL_GENERATORS}."
            )
    return states


def checked_generator_states(states: Any) -> dict[str, Any]:
    """``states`` (from :func:`global_generator_states`, possibly through a checkpoint, which
    may turn tuples into lists) in the form the generators take, each tried on a fresh
    generator; no global generator is changed.

    Raises:
        ValueError: naming what is wrong, for anything else.
    """
    if not isinstance(states, Mapping) or not set(states) <= set(GLOBAL_GENERATORS):
        raise ConfigurationError(
            f"expected a dict of global generator states keyed by {GLOBAL_GENERATORS}, got "
            f"{type(states).__name__} {sorted(states) if isinstance(states, Mapping) else ''}"
        )
    checked: dict[str, Any] = {}
    try:
        for name, state in states.items():
            if name == "python":
                version, internal, gauss = state
                state = (version, tuple(internal), gauss)
                _py_random.Random().setstate(state)
            elif name == "numpy":
                state = tuple(state)
                np.random.RandomState().set_state(state)
            else:
                if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                    raise WrongTypeError(f"expected a uint8 tensor, got {type(state).__name__}")
                # Its own storage: set_state reads a view (of a file's buffer) from the start.
                state = state.detach().cpu().clone()
                torch.Generator().set_state(state)
            checked[name] = state
    except (TypeError, ValueError, RuntimeError, LookupError, OverflowError) as exc:
        raise ConfigurationError(f"invalid {name} generator state ({exc}).") from None
    return checked


def set_global_generator_states(states: Mapping[str, Any]) -> None:
    """Put back states :func:`global_generator_states` captured.

    Raises:
        ValueError: for a state a generator does not accept (nothing is changed then; see
            :func:`checked_generator_states`).
    """
    for name, state in checked_generator_states(states).items():
        if name == "python":
            _py_random.setstate(state)
        elif name == "numpy":
            np.random.set_state(state)
        else:
            torch.set_rng_state(state)


def generator_marks() -> dict[str, Any]:
    """A cheap comparable mark of each global generator's state (about 12 us for the three):
    two marks differ when the generator drew in between (:func:`drawn_generators`)."""
    return {"python": _py_random.getstate(), "numpy": _numpy_mark(), "torch": torch.get_rng_state()}


# NumPy's global MT19937 state as raw bytes (624 words and the position): 1 us, against 50 us
# for np.random.get_state(), which copies it into new objects.
_MT19937_BYTES = 624 * 4 + 4


def _numpy_mark() -> Any:
    get_bit_generator = getattr(np.random, "get_bit_generator", None)  # NumPy >= 1.25
    generator: Any = get_bit_generator() if get_bit_generator is not None else None
    if type(generator).__name__ == "MT19937":
        return ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES)
    # Older NumPy, or a bit generator the user set: the whole state.
    kind, key, *rest = np.random.get_state()
    return (kind, np.asarray(key).tobytes(), *rest)


def drawn_generators(before: Mapping[str, Any], after: Mapping[str, Any]) -> set[str]:
    """The generators whose :func:`generator_marks` differ."""
    drawn = set()
    for name, mark in before.items():
        other = after.get(name)
        if isinstance(mark, torch.Tensor):
            same = isinstance(other, torch.Tensor) and torch.equal(mark, other)
        else:
            same = mark == other
        if not same:
            drawn.add(name)
    return drawn
