"""Seeding every random number generator a training script touches."""

from __future__ import annotations

import os
import random as _py_random

import numpy as np
import torch

__all__ = ["set_seed"]


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
        raise TypeError(f"set_seed expects an integer seed, got {seed!r} ({type(seed).__name__}).")
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
