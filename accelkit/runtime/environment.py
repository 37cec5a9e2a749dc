"""Launch settings read from the environment, without importing torch.

``accelkit launch`` and the CLI validate these before any worker starts, so this module stays
free of heavy imports; :mod:`accelkit.runtime.state` re-exports what a training script needs.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

from accelkit.errors import ConfigurationError

__all__ = [
    "ACCELERATE_ENV_MIXED_PRECISION",
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "PrecisionType",
    "SUPPORTED_PRECISIONS",
    "clear_environment",
    "env_flag",
    "env_value",
    "parse_mixed_precision",
]

# Environment variables that `accelkit launch` sets for its workers. The ``ACCELERATE_`` spelling
# is read too so that settings written for the reference tool keep working.
ENV_USE_CPU = "ACCELKIT_USE_CPU"
ENV_MIXED_PRECISION = "ACCELKIT_MIXED_PRECISION"
#: The reference's spelling of :data:`ENV_MIXED_PRECISION`, which its workers' code may read.
ACCELERATE_ENV_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
_LEGACY_ENV = {
    ENV_USE_CPU: "ACCELERATE_USE_CPU",
    ENV_MIXED_PRECISION: ACCELERATE_ENV_MIXED_PRECISION,
}


class PrecisionType(str, enum.Enum):
    """The mixed-precision modes of the reference.

    ``FP8`` exists so that scripts comparing against it keep working, but selecting it fails:
    FP8 training (Transformer Engine, MS-AMP, torchao) is out of accelkit's scope.
    """

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


#: The modes accelkit runs; :attr:`PrecisionType.FP8` is refused by :func:`parse_mixed_precision`.
SUPPORTED_PRECISIONS = (PrecisionType.NO, PrecisionType.FP16, PrecisionType.BF16)


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
        ValueError: naming the bad value and the accepted ones (``"fp8"`` is a known mode of the
            reference that accelkit refuses: FP8 training is out of scope).
    """
    if value is None:
        value = env_value(ENV_MIXED_PRECISION) or "no"
    normalized = value.value if isinstance(value, PrecisionType) else str(value).strip().lower()
    accepted = ", ".join(repr(p.value) for p in SUPPORTED_PRECISIONS)
    if normalized == PrecisionType.FP8.value:
        raise ConfigurationError(
            f"Unknown mixed_precision {normalized!r} for accelkit: it does not do FP8 training "
            f"(Transformer Engine / MS-AMP / torchao are out of scope). Expected one of "
            f"{accepted}."
        )
    try:
        return PrecisionType(normalized)
    except ValueError:
        raise ConfigurationError(
            f"Unknown mixed_precision {value!r}. Expected one of {accepted}."
        ) from None


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Empty ``os.environ`` inside the block; restore it after.

    Here, on the runtime floor, because the kwargs handlers compute their environment-free
    defaults with it (``accelkit.utils`` re-exports it for scripts written for Accelerate).
    """
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
