"""Everything scripts written for the reference import from ``accelerate.utils``.

``from accelerate.utils import set_seed, ProjectConfiguration`` ports as
``from accelkit.utils import set_seed, ProjectConfiguration``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr

_PUBLIC = {
    "GeneralTracker": "accelkit.trackers",
    "register_tracker": "accelkit.trackers",
    "AutocastKwargs": "accelkit.kwargs_handlers",
    "DistributedDataParallelKwargs": "accelkit.kwargs_handlers",
    "GradScalerKwargs": "accelkit.kwargs_handlers",
    "GradientAccumulationPlugin": "accelkit.optim",
    "broadcast": "accelkit.ops",
    "broadcast_object_list": "accelkit.ops",
    "concatenate": "accelkit.ops",
    "gather": "accelkit.ops",
    "gather_object": "accelkit.ops",
    "pad_across_processes": "accelkit.ops",
    "recursively_apply": "accelkit.ops",
    "reduce": "accelkit.ops",
    "send_to_device": "accelkit.ops",
    "DistributedType": "accelkit.state",
    "PrecisionType": "accelkit.state",
    "FullyShardedDataParallelPlugin": "accelkit.fsdp",
    "ProjectConfiguration": "accelkit.checkpointing",
    "load_checkpoint_in_model": "accelkit.checkpointing",
    "LoggerType": "accelkit.trackers",
    "DataLoaderConfiguration": "accelkit.data",
    "skip_first_batches": "accelkit.data",
    "set_seed": "accelkit.random",
}

__all__ = [
    "GeneralTracker",
    "register_tracker",
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "DataLoaderConfiguration",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "LoggerType",
    "PrecisionType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "gather",
    "gather_object",
    "load_checkpoint_in_model",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
]
__getattr__ = lazy_getattr(__name__, _PUBLIC)

if TYPE_CHECKING:
    from accelkit.checkpointing import ProjectConfiguration, load_checkpoint_in_model
    from accelkit.data import DataLoaderConfiguration, skip_first_batches
    from accelkit.fsdp import FullyShardedDataParallelPlugin
    from accelkit.kwargs_handlers import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
    )
    from accelkit.ops import (
        broadcast,
        broadcast_object_list,
        concatenate,
        gather,
        gather_object,
        pad_across_processes,
        recursively_apply,
        reduce,
        send_to_device,
    )
    from accelkit.optim import GradientAccumulationPlugin
    from accelkit.random import set_seed
    from accelkit.state import DistributedType, PrecisionType
    from accelkit.trackers import GeneralTracker, LoggerType, register_tracker
