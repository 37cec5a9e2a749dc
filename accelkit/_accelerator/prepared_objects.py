"""The objects an :class:`~accelkit.Accelerator` prepared, in one typed registry.

``prepare`` appends to it; saving and loading read it; ``free_memory`` empties it. The
accelerator's parts receive this object in their constructors instead of reading each other's
attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from accelkit.training.optim import AcceleratedOptimizer, AcceleratedScheduler

__all__ = ["PreparedObjects"]


class PreparedObjects:
    """What ``prepare`` returned, by kind, and the fp16 grad scaler they share.

    Attributes:
        models: prepared models, in preparation order.
        optimizers: prepared :class:`~accelkit.training.optim.AcceleratedOptimizer` s.
        schedulers: prepared :class:`~accelkit.training.optim.AcceleratedScheduler` s.
        dataloaders: prepared dataloaders.
        scaler: the ``torch.amp.GradScaler`` of ``"fp16"`` (None otherwise).
    """

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[AcceleratedOptimizer] = []
        self.schedulers: list[AcceleratedScheduler] = []
        self.dataloaders: list[Any] = []
        self.scaler = scaler

    def clear(self) -> None:
        """Forget every prepared object (the lists stay the same objects)."""
        for registry in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            registry.clear()
