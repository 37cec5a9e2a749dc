"""Human sizes and durations: ``"5GB"`` -> bytes, ``"6h"`` -> seconds. The one parser of each, for
settings (``max_shard_size``, ``max_total_bytes``) and command-line flags (``ckpt prune
--max-bytes 5GB --keep-recent 2d``).

Public API: :func:`parse_bytes`, :func:`parse_duration`.
"""

from __future__ import annotations

import math
import re

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = ["parse_bytes", "parse_duration"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_bytes(value: int | str, name: str) -> int:
    """``"10GB"`` -> 10_000_000_000 (``KB/MB/GB/TB`` are powers of 10, ``KiB``... of 2); an int
    is bytes.

    Args:
        value: an int > 0 or a string like ``"500MB"``, ``"2GiB"``, ``"1024"``.
        name: the setting or flag, for the error.

    Raises:
        ValueError: naming ``name``, the value and what is expected.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigurationError(f"{name} must be > 0, got {value}.")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ConfigurationError(
            f"Invalid {name} {short(value)}: expected an int (bytes) or a string like "
            "'10GB', '500MB', '2GiB'."
        )
    unit = (match.group(2) or "B").upper()
    number = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if number <= 0:
        raise ConfigurationError(f"{name} must be > 0, got {short(value)}.")
    return number


def parse_duration(value: float | str, name: str) -> float:
    """``"6h"`` -> 21600.0: a number of seconds, or one with a unit ``s``, ``m``, ``h``, ``d``
    or ``w``.

    Raises:
        ValueError: naming ``name``, the value and what is expected (a finite duration > 0).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION_RE.match(str(value))
        if not match:
            raise ConfigurationError(
                f"Invalid {name} {short(value)}: expected a number of seconds or a duration "
                "like '90s', '30m', '6h', '2d', '1w'."
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"{name} must be a finite duration > 0, got {short(value)}; e.g. 6h (or 21600 seconds)."
        )
    return seconds
