"""Accelerate's ``accelerate.state`` names: who this process is, its device and process group.

A public path for scripts ported by changing their imports. The implementation lives in
:mod:`accelkit.runtime.state`; ``GradientState`` lives with the optimizer wrappers that read it
(:mod:`accelkit.training.optim`) and is importable from here as in the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelkit.runtime.state import (
    ENV_MIXED_PRECISION,
    ENV_USE_CPU,
    AcceleratorState,
    DistributedType,
    PartialState,
    PrecisionType,
    destroy_process_group,
    env_flag,
    env_value,
    parse_mixed_precision,
)

__all__ = [
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "AcceleratorState",
    "DistributedType",
    "GradientState",
    "PartialState",
    "PrecisionType",
    "destroy_process_group",
    "env_flag",
    "env_value",
    "parse_mixed_precision",
]

if TYPE_CHECKING:
    from accelkit.training.optim import GradientState


def __getattr__(name: str) -> Any:
    if name == "GradientState":
        from accelkit.training.optim import GradientState

        return GradientState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
