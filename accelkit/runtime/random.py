"""Seeding every random number generator a training script touches, and keeping them in step
across processes."""

from __future__ import annotations

import enum
import os
import random as _py_random

import numpy as np
import torch
import torch.distributed as dist

from accelkit.errors import ConfigurationError, WrongTypeError

__all__ = ["RNGType", "set_seed", "synchronize_rng_state", "synchronize_rng_states"]


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
