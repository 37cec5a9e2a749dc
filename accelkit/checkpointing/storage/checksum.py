"""Checksums of checkpoint files, computed while the bytes stream past.

A checksum is written as ``"<algorithm>:<hex digest>"``, e.g. ``"xxh3_128:9f0c..."``. The
default algorithm is XXH3-128 (from the ``xxhash`` package: ~15 GB/s, so hashing never slows a
save down); ``sha256`` is understood too, and is the fallback if ``xxhash`` is missing.

Public functions:

- :func:`new_hasher` -- a fresh hasher (``update(bytes)``, ``hexdigest()``) for an algorithm.
- :func:`format_checksum` / :func:`parse_checksum` -- the ``"algo:hex"`` text form.
- :func:`checksum_bytes` -- the checksum of an in-memory buffer.
- :data:`DEFAULT_ALGORITHM` -- what new files are hashed with.
- :func:`memory_digest` -- a fast digest of raw memory, read in place (an overlapped snapshot's
  check that what it copied is what was there at ``save_state``).
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any, Protocol

from accelkit.errors import ConfigurationError, UsageError

__all__ = [
    "DEFAULT_ALGORITHM",
    "MEMORY_DIGEST_AVAILABLE",
    "SUPPORTED_ALGORITHMS",
    "Hasher",
    "checksum_bytes",
    "format_checksum",
    "memory_digest",
    "new_hasher",
    "parse_checksum",
]

_xxhash: Any
try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; this keeps a broken env usable
    _xxhash = None


class Hasher(Protocol):
    """What a hasher offers: ``update`` with bytes, then ``hexdigest``."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


SUPPORTED_ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT_ALGORITHM = "xxh3_128" if _xxhash is not None else "sha256"


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """Return a fresh hasher for ``algorithm``.

    Args:
        algorithm: ``"xxh3_128"`` or ``"sha256"``.

    Raises:
        ConfigurationError: (a ``ValueError``) for an unknown algorithm, or ``xxh3_128``
            without the ``xxhash`` package.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        if _xxhash is None:
            raise ConfigurationError(
                "This checkpoint's checksums use xxh3_128, which needs the 'xxhash' package: "
                "pip install xxhash"
            )
        hasher: Hasher = _xxhash.xxh3_128()
        return hasher
    raise ConfigurationError(
        f"Unknown checksum algorithm {algorithm!r}; expected one of "
        f"{', '.join(SUPPORTED_ALGORITHMS)}."
    )


def format_checksum(algorithm: str, hexdigest: str) -> str:
    """Join an algorithm and a hex digest into the ``"algo:hex"`` form stored in manifests."""
    return f"{algorithm}:{hexdigest}"


def parse_checksum(text: str) -> tuple[str, str]:
    """Split ``"algo:hex"`` into ``(algo, hex)``.

    Raises:
        ConfigurationError: (a ``ValueError``) if the text is not of that form or names an
            unknown algorithm.
    """
    algorithm, sep, digest = text.partition(":")
    if not sep or algorithm not in SUPPORTED_ALGORITHMS or not digest:
        raise ConfigurationError(
            f"Invalid checksum {text!r}: expected '<algorithm>:<hex digest>' with algorithm one "
            f"of {', '.join(SUPPORTED_ALGORITHMS)}."
        )
    try:
        int(digest, 16)
    except ValueError:
        raise ConfigurationError(
            f"Invalid checksum {text!r}: the digest is not hexadecimal."
        ) from None
    return algorithm, digest.lower()


def checksum_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Return the ``"algo:hex"`` checksum of an in-memory buffer."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return format_checksum(algorithm, hasher.hexdigest())


MEMORY_DIGEST_AVAILABLE = _xxhash is not None
"""Whether :func:`memory_digest` works (it needs the ``xxhash`` package, a dependency)."""


def memory_digest(address: int, nbytes: int) -> int:
    """Return the XXH3-64 digest of ``nbytes`` bytes of memory at ``address``, read in place.

    The GIL is released while hashing, so several threads hash at once (near the memory's read
    bandwidth: about two thirds of the time of copying the same bytes on the 2-core VM).

    Args:
        address: the first byte (e.g. ``tensor.data_ptr()``); the memory must stay alive.
        nbytes: how many bytes, at least 1.

    Raises:
        UsageError: (a ``RuntimeError``) without the ``xxhash`` package (see
            :data:`MEMORY_DIGEST_AVAILABLE`).
    """
    if _xxhash is None:
        raise UsageError("memory_digest needs the 'xxhash' package: pip install xxhash")
    digest: int = _xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(address))
    return digest
