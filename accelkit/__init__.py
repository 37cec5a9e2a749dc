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
    "TrackerOptions": "accelkit.trackers",
    "DataLoaderConfiguration": "accelkit.data.preparation",
    "skip_first_batches": "accelkit.data.preparation",
    "set_seed": "accelkit.runtime.random",
}

# Each public name is listed once, in _PUBLIC (its module) and, for type checkers, in the
# TYPE_CHECKING block below (tests/test_public_api.py keeps the two the same); the names of
# the reference that accelkit refuses, added next, are importable but not listed.
__all__ = ["AccelkitError", "__version__", *_PUBLIC]
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
    from accelkit.accelerator import Accelerator as Accelerator
    from accelkit.checkpointing import (
        ProjectConfiguration as ProjectConfiguration,
    )
    from accelkit.checkpointing import (
        load_checkpoint_in_model as load_checkpoint_in_model,
    )
    from accelkit.data.preparation import (
        DataLoaderConfiguration as DataLoaderConfiguration,
    )
    from accelkit.data.preparation import (
        skip_first_batches as skip_first_batches,
    )
    from accelkit.fsdp.runtime import (
        FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin,
    )
    from accelkit.launch.debug import debug_launcher as debug_launcher
    from accelkit.launch.notebook import notebook_launcher as notebook_launcher
    from accelkit.logging import get_logger as get_logger
    from accelkit.runtime.random import (
        set_seed as set_seed,
    )
    from accelkit.runtime.random import (
        synchronize_rng_states as synchronize_rng_states,
    )
    from accelkit.runtime.state import (
        AcceleratorState as AcceleratorState,
    )
    from accelkit.runtime.state import (
        DistributedType as DistributedType,
    )
    from accelkit.runtime.state import (
        PartialState as PartialState,
    )
    from accelkit.runtime.state import (
        PrecisionType as PrecisionType,
    )
    from accelkit.trackers import (
        GeneralTracker as GeneralTracker,
    )
    from accelkit.trackers import (
        LoggerType as LoggerType,
    )
    from accelkit.trackers import (
        TrackerOptions as TrackerOptions,
    )
    from accelkit.trackers import (
        register_tracker as register_tracker,
    )
    from accelkit.training.dynamo import TorchDynamoPlugin as TorchDynamoPlugin
    from accelkit.training.kwargs_handlers import (
        AutocastKwargs as AutocastKwargs,
    )
    from accelkit.training.kwargs_handlers import (
        DDPCommunicationHookType as DDPCommunicationHookType,
    )
    from accelkit.training.kwargs_handlers import (
        DistributedDataParallelKwargs as DistributedDataParallelKwargs,
    )
    from accelkit.training.kwargs_handlers import (
        GradScalerKwargs as GradScalerKwargs,
    )
    from accelkit.training.kwargs_handlers import (
        InitProcessGroupKwargs as InitProcessGroupKwargs,
    )
    from accelkit.training.optim import GradientAccumulationPlugin as GradientAccumulationPlugin
    from accelkit.training.profiling import ProfileKwargs as ProfileKwargs
    from accelkit.utils.imports import is_rich_available as is_rich_available
    from accelkit.utils.memory import find_executable_batch_size as find_executable_batch_size
