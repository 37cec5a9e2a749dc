"""accelkit: run a PyTorch training loop anywhere, track it, and checkpoint it safely.

Public names are resolved on first use, so ``import accelkit`` does not import an optional
tracker SDK or the checkpoint storage layer until you touch them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr
from accelkit._version import __version__
from accelkit.errors import AccelkitError

_PUBLIC = {
    "AutocastKwargs": "accelkit.training.kwargs_handlers",
    "DDPCommunicationHookType": "accelkit.training.kwargs_handlers",
    "InitProcessGroupKwargs": "accelkit.training.kwargs_handlers",
    "ProfileKwargs": "accelkit.training.profiling",
    "TorchDynamoPlugin": "accelkit.training.dynamo",
    "AcceleratorState": "accelkit.runtime.state",
    "debug_launcher": "accelkit.launch.debug",
    "find_executable_batch_size": "accelkit.utils.memory",
    "is_rich_available": "accelkit.utils.imports",
    "synchronize_rng_states": "accelkit.runtime.random",
    "DistributedDataParallelKwargs": "accelkit.training.kwargs_handlers",
    "GradScalerKwargs": "accelkit.training.kwargs_handlers",
    "GradientAccumulationPlugin": "accelkit.training.optim",
    "Accelerator": "accelkit.accelerator",
    "PartialState": "accelkit.runtime.state",
    "FullyShardedDataParallelPlugin": "accelkit.fsdp.runtime",
    "DistributedType": "accelkit.runtime.state",
    "PrecisionType": "accelkit.runtime.state",
    "notebook_launcher": "accelkit.launch.notebook",
    "get_logger": "accelkit.logging",
    "ProjectConfiguration": "accelkit.checkpointing",
    "load_checkpoint_in_model": "accelkit.checkpointing",
    "GeneralTracker": "accelkit.trackers",
    "LoggerType": "accelkit.trackers",
    "register_tracker": "accelkit.trackers",
    "DataLoaderConfiguration": "accelkit.data.preparation",
    "skip_first_batches": "accelkit.data.preparation",
    "set_seed": "accelkit.runtime.random",
}

__all__ = [
    "AccelkitError",
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
    from accelkit.data.preparation import DataLoaderConfiguration, skip_first_batches
    from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin
    from accelkit.launch.debug import debug_launcher
    from accelkit.launch.notebook import notebook_launcher
    from accelkit.logging import get_logger
    from accelkit.runtime.random import set_seed, synchronize_rng_states
    from accelkit.runtime.state import (
        AcceleratorState,
        DistributedType,
        PartialState,
        PrecisionType,
    )
    from accelkit.trackers import GeneralTracker, LoggerType, register_tracker
    from accelkit.training.dynamo import TorchDynamoPlugin
    from accelkit.training.kwargs_handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
    )
    from accelkit.training.optim import GradientAccumulationPlugin
    from accelkit.training.profiling import ProfileKwargs
    from accelkit.utils.imports import is_rich_available
    from accelkit.utils.memory import find_executable_batch_size
