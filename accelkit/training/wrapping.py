"""The one way to reach the module inside what ``prepare`` and ``torch.compile`` put around it.

:func:`peel` takes off ``DistributedDataParallel``, ``DataParallel`` and ``torch.compile``'s
``OptimizedModule``, in any nesting. ``Accelerator.unwrap_model``
(:func:`accelkit.training.loop.unwrap_model`) and the checkpoint code
(:func:`accelkit.checkpointing.objects.contents.unwrap_model`) are both written on it.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

__all__ = ["peel"]


def peel(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """``(the innermost module, the outermost torch.compile wrapper or None)``.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> peel(torch.compile(net))[0] is net
        True
    """
    compiled: torch.nn.Module | None = None
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            compiled = compiled or model
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model, compiled
