"""The reference's ``accelerate.utils.dataclasses``: enums, plugins and kwargs handlers."""

from __future__ import annotations

from accelkit.checkpointing import ProjectConfiguration
from accelkit.data import DataLoaderConfiguration
from accelkit.dynamo import DynamoBackend, TorchDynamoPlugin
from accelkit.fsdp import FullyShardedDataParallelPlugin
from accelkit.kwargs_handlers import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from accelkit.optim import GradientAccumulationPlugin
from accelkit.profiling import ProfileKwargs
from accelkit.random import RNGType
from accelkit.state import DistributedType, PrecisionType
from accelkit.trackers import LoggerType

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
