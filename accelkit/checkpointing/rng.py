"""Random generator states of one process: Python, NumPy, torch (CPU) and CUDA.

Stored through :mod:`~accelkit.checkpointing.state_io` (tensors in safetensors, the rest in
JSON), never pickled.

Public API:

- :func:`capture_rng_state() <capture_rng_state>` -- a dict with ``python``, ``numpy``,
  ``torch`` and, when CUDA is initialised, ``cuda`` (one state per visible device).
- :func:`restore_rng_state(state, source) <restore_rng_state>` -- put them back; raises
  :class:`~accelkit.checkpointing.errors.CorruptCheckpointError` naming ``source`` for a
  malformed state.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """The current states of Python's, NumPy's, torch's and CUDA's global generators."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Any, source: str = "random states") -> None:
    """Restore what :func:`capture_rng_state` captured.

    Raises:
        CorruptCheckpointError: if ``state`` is not such a dict.
        CheckpointMismatchError: if it holds CUDA states for more devices than are visible.
    """
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise CorruptCheckpointError(
            f"{source}: expected Python, NumPy and torch generator states; the file is damaged."
        )
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CorruptCheckpointError(f"{source}: invalid generator state ({exc}).") from None
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) > torch.cuda.device_count():
            raise CheckpointMismatchError(
                f"{source}: holds CUDA generator states for {len(cuda)} devices but only "
                f"{torch.cuda.device_count()} are visible; resume on the same devices."
            )
        torch.cuda.set_rng_state_all(cuda)
