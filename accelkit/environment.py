"""Launch settings read from the environment, without importing torch.

``accelkit launch`` and the CLI validate these before any worker starts, so this module stays
free of heavy imports; :mod:`accelkit.state` re-exports what a training script needs.
"""

from __future__ import annotations

import enum
import os

__all__ = [
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "PrecisionType",
    "env_flag",
    "env_value",
    "parse_mixed_precision",
]

# Environment variables that `accelkit launch` sets for its workers. The ``ACCELERATE_`` spelling
# is read too so that settings written for the reference tool keep working.
ENV_USE_CPU = "ACCELKIT_USE_CPU"
ENV_MIXED_PRECISION = "ACCELKIT_MIXED_PRECISION"
_LEGACY_ENV = {ENV_USE_CPU: "ACCELERATE_USE_CPU", ENV_MIXED_PRECISION: "ACCELERATE_MIXED_PRECISION"}


class PrecisionType(str, enum.Enum):
    """The mixed-precision modes ``Accelerator(mixed_precision=...)`` accepts."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"


def env_value(name: str) -> str | None:
    """Read an accelkit environment variable, falling back to its ``ACCELERATE_`` spelling."""
    value = os.environ.get(name)
    if value is None and name in _LEGACY_ENV:
        value = os.environ.get(_LEGACY_ENV[name])
    return value


def env_flag(name: str, default: bool = False) -> bool:
    """Read a boolean environment variable (``1/true/yes/on`` are true)."""
    value = env_value(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def parse_mixed_precision(value: str | PrecisionType | None) -> PrecisionType:
    """Validate a mixed-precision setting.

    Args:
        value: ``"no"``, ``"fp16"``, ``"bf16"`` (or the enum), or None to read
            ``ACCELKIT_MIXED_PRECISION`` / ``ACCELERATE_MIXED_PRECISION`` (default ``"no"``).

    Raises:
        ValueError: naming the bad value and the accepted ones.
    """
    if value is None:
        value = env_value(ENV_MIXED_PRECISION) or "no"
    if isinstance(value, PrecisionType):
        return value
    normalized = str(value).strip().lower()
    try:
        return PrecisionType(normalized)
    except ValueError:
        accepted = ", ".join(repr(p.value) for p in PrecisionType)
        raise ValueError(
            f"Unknown mixed_precision {value!r}. Expected one of {accepted}."
        ) from None
