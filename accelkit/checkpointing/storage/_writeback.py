"""Start the disk write of a range just written, without waiting for it (Linux).

Without this, written pages sit dirty in the page cache until the ``fsync`` at close, so
hashing, copying and the disk take turns. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` after each
chunk lets the disk work while the next chunk is hashed (measured by
``python -m benchmarks.diag_write``). Durability still comes from the ``fsync`` at close; this
only starts the work earlier, so it is skipped silently where the call does not exist.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

__all__ = ["start_writeback"]

_SYNC_FILE_RANGE_WRITE = 2


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _load()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to begin writing ``length`` bytes at ``offset`` of ``fd`` to disk."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
