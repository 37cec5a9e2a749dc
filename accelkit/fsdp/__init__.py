"""Sharded data parallelism with PyTorch's FSDP2.

``accelkit.fsdp`` is a public path: its names are those of :mod:`.runtime` (sharding, state
dicts, clipping). The room's modules: :mod:`.runtime`, :mod:`.plugin` (the options:
``FullyShardedDataParallelPlugin`` and its launch flags) and :mod:`.fsdp1_options` (Accelerate's
FSDP1 options, translated or refused by name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr

__all__ = [
    "ENV_USE_FSDP",
    "FSDPRuntime",
    "FullyShardedDataParallelPlugin",
    "ParamRemap",
    "add_launch_arguments",
    "clip_grad_norm_",
    "gather_full_model",
    "get_optimizer_state_dict",
    "get_state_dict",
    "is_sharded",
    "launch_env",
    "no_sync",
    "plugin_from_env_or",
    "repoint_optimizer",
    "set_optimizer_state_dict",
    "set_state_dict",
    "shard_model",
    "wrap_units",
]

# Resolved on first use: importing one module of this room (``accelkit.fsdp.<module>``) runs
# this file, and must not import what the room's heavier modules need (torch, for the
# command line's cheap commands).
__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "accelkit.fsdp.runtime"))

if TYPE_CHECKING:
    from accelkit.fsdp.runtime import (
        ENV_USE_FSDP,
        FSDPRuntime,
        FullyShardedDataParallelPlugin,
        ParamRemap,
        add_launch_arguments,
        clip_grad_norm_,
        gather_full_model,
        get_optimizer_state_dict,
        get_state_dict,
        is_sharded,
        launch_env,
        no_sync,
        plugin_from_env_or,
        repoint_optimizer,
        set_optimizer_state_dict,
        set_state_dict,
        shard_model,
        wrap_units,
    )
