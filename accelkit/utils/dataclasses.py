"""The reference's ``accelerate.utils.dataclasses``: enums, plugins and kwargs handlers."""

from __future__ import annotations

from accelkit.checkpointing import ProjectConfiguration
from accelkit.data.preparation import DataLoaderConfiguration
from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin
from accelkit.runtime.random import RNGType
from accelkit.runtime.state import DistributedType, PrecisionType
from accelkit.trackers import LoggerType
from accelkit.training.dynamo import DynamoBackend, TorchDynamoPlugin
from accelkit.training.kwargs_handlers import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from accelkit.training.optim import GradientAccumulationPlugin
from accelkit.training.profiling import ProfileKwargs

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TorchDynamoPlugin",
]
