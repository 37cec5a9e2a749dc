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
    "DDPCommunicationHookType": "accelkit.kwargs_handlers",
    "InitProcessGroupKwargs": "accelkit.kwargs_handlers",
    "ProfileKwargs": "accelkit.profiling",
    "TorchDynamoPlugin": "accelkit.dynamo",
    "AcceleratorState": "accelkit.state",
    "debug_launcher": "accelkit.debug_launch",
    "find_executable_batch_size": "accelkit.utils.memory",
    "is_rich_available": "accelkit.utils.imports",
    "synchronize_rng_states": "accelkit.random",
    "DistributedDataParallelKwargs": "accelkit.kwargs_handlers",
    "GradScalerKwargs": "accelkit.kwargs_handlers",
    "GradientAccumulationPlugin": "accelkit.optim",
    "Accelerator": "accelkit.accelerator",
    "PartialState": "accelkit.state",
    "FullyShardedDataParallelPlugin": "accelkit.fsdp",
    "DistributedType": "accelkit.state",
    "PrecisionType": "accelkit.state",
    "notebook_launcher": "accelkit.notebook_launch",
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
    "AcceleratorState",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "TorchDynamoPlugin",
    "debug_launcher",
    "find_executable_batch_size",
    "is_rich_available",
    "synchronize_rng_states",
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
# Names of the reference accelkit refuses: importable, raising OutOfScopeError when used.
for _name in (
    "DeepSpeedPlugin",
    "ParallelismConfig",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "prepare_pippy",
):
    _PUBLIC[_name] = "accelkit.out_of_scope"
__getattr__ = lazy_getattr(__name__, _PUBLIC)

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator
    from accelkit.checkpointing import ProjectConfiguration, load_checkpoint_in_model
    from accelkit.data import DataLoaderConfiguration, skip_first_batches
    from accelkit.debug_launch import debug_launcher
    from accelkit.dynamo import TorchDynamoPlugin
    from accelkit.fsdp import FullyShardedDataParallelPlugin
    from accelkit.kwargs_handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
    )
    from accelkit.logging import get_logger
    from accelkit.notebook_launch import notebook_launcher
    from accelkit.optim import GradientAccumulationPlugin
    from accelkit.profiling import ProfileKwargs
    from accelkit.random import set_seed, synchronize_rng_states
    from accelkit.state import AcceleratorState, DistributedType, PartialState, PrecisionType
    from accelkit.trackers import GeneralTracker, LoggerType, register_tracker
    from accelkit.utils.imports import is_rich_available
    from accelkit.utils.memory import find_executable_batch_size
