"""Random generator states of one process: Python, NumPy, torch (CPU) and CUDA.

Stored through :mod:`~accelkit.checkpointing.formats.state_io` (tensors in safetensors, the rest in
JSON), never pickled.

Public API:

- :func:`capture_rng_state() <capture_rng_state>` -- a dict with ``python``, ``numpy``,
  ``torch`` and, when CUDA is initialised, ``cuda`` (one state per visible device).
- :func:`check_rng_state(state, source) <check_rng_state>` -- refuse a malformed state without
  changing any generator.
- :func:`restore_rng_state(state, source) <restore_rng_state>` -- put them back; raises
  :class:`~accelkit.checkpointing.errors.CorruptCheckpointError` naming ``source`` for a
  malformed state.
"""

from __future__ import annotations

from typing import Any

import torch

from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError
from accelkit.runtime.random import (
    GLOBAL_GENERATORS,
    checked_generator_states,
    global_generator_states,
    set_global_generator_states,
)

__all__ = ["capture_rng_state", "check_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """The current states of Python's, NumPy's, torch's and CUDA's global generators."""
    state = global_generator_states()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng_state(state: Any, source: str = "random states") -> None:
    """Check that :func:`restore_rng_state` would accept ``state``, changing no generator (each
    state is tried on a fresh generator), so a load can refuse it before restoring anything.

    Raises:
        CorruptCheckpointError: if ``state`` is not what :func:`capture_rng_state` returns.
        CheckpointMismatchError: if it holds CUDA states for more devices than are visible.
    """
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise CorruptCheckpointError(
            f"{source}: expected Python, NumPy and torch generator states; the file is damaged."
        )
    try:
        checked_generator_states({name: state[name] for name in GLOBAL_GENERATORS})
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: {exc}") from None
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
        raise CheckpointMismatchError(
            f"{source}: holds CUDA generator states for {len(cuda)} devices but only "
            f"{torch.cuda.device_count()} are visible; resume on the same devices."
        )


def restore_rng_state(state: Any, source: str = "random states") -> None:
    """Restore what :func:`capture_rng_state` captured (checked first by
    :func:`check_rng_state`).

    Raises:
        CorruptCheckpointError: if ``state`` is not such a dict.
        CheckpointMismatchError: if it holds CUDA states for more devices than are visible.
    """
    check_rng_state(state, source)
    set_global_generator_states({name: state[name] for name in GLOBAL_GENERATORS})
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
