"""accelkit: run a PyTorch training loop anywhere, track it, and checkpoint it safely.

Public names are resolved on first use, so ``import accelkit`` does not import an optional
tracker SDK or the checkpoint storage layer until you touch them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr
from accelkit._version import __version__

_PUBLIC = {
    "AutocastKwargs": "accelkit.kwargs_handlers",
    "DistributedDataParallelKwargs": "accelkit.kwargs_handlers",
    "GradScalerKwargs": "accelkit.kwargs_handlers",
    "GradientAccumulationPlugin": "accelkit.optim",
    "Accelerator": "accelkit.accelerator",
    "PartialState": "accelkit.state",
    "FullyShardedDataParallelPlugin": "accelkit.fsdp",
    "DistributedType": "accelkit.state",
    "PrecisionType": "accelkit.state",
    "notebook_launcher": "accelkit.launch",
    "get_logger": "accelkit.logging",
    "ProjectConfiguration": "accelkit.checkpointing",
    "load_checkpoint_in_model": "accelkit.checkpointing",
    "GeneralTracker": "accelkit.trackers",
    "LoggerType": "accelkit.trackers",
    "register_tracker": "accelkit.trackers",
    "DataLoaderConfiguration": "accelkit.data",
    "skip_first_batches": "accelkit.data",
    "set_seed": "accelkit.random",
}

__all__ = [
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "Accelerator",
    "DataLoaderConfiguration",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "LoggerType",
    "PartialState",
    "PrecisionType",
    "ProjectConfiguration",
    "__version__",
    "get_logger",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "register_tracker",
    "set_seed",
    "skip_first_batches",
]
__getattr__ = lazy_getattr(__name__, _PUBLIC)

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator
    from accelkit.checkpointing import ProjectConfiguration, load_checkpoint_in_model
    from accelkit.data import DataLoaderConfiguration, skip_first_batches
    from accelkit.fsdp import FullyShardedDataParallelPlugin
    from accelkit.kwargs_handlers import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
    )
    from accelkit.launch import notebook_launcher
    from accelkit.logging import get_logger
    from accelkit.optim import GradientAccumulationPlugin
    from accelkit.random import set_seed
    from accelkit.state import DistributedType, PartialState, PrecisionType
    from accelkit.trackers import GeneralTracker, LoggerType, register_tracker
