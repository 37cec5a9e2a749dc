"""Diagnosis: what a durable write of N bytes costs, piece by piece (not part of the run).

``python -m benchmarks.diag_write [GB] [rounds]`` writes the same buffer to one file in 16 MiB
chunks, four ways, alternating, and prints for each the time to hand the bytes to the kernel
(``write``), the time ``fsync`` then waits, and the total (best and median):

- ``raw``: write + fsync (the limit ``bench_save_load`` compares with);
- ``raw+hash``: the same, hashing every chunk with XXH3-128 first (what accelkit's
  ``HashingWriter`` does);
- ``raw+kick`` / ``raw+hash+kick``: the same, asking the kernel to start writing each chunk
  back at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux), so the disk works while the
  next chunk is hashed and copied instead of only once ``fsync`` is called.

Use it to tell how much of a gap between accelkit's save and the raw write is the checksum, and
how much early write-back would win back.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable

from benchmarks.common import median, rmtree, scratch_dir

CHUNK = 16 << 20
SYNC_FILE_RANGE_WRITE = 2


def _kicker() -> Callable[[int, int, int], None] | None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def kick(fd: int, offset: int, length: int) -> None:
        fn(fd, offset, length, SYNC_FILE_RANGE_WRITE)

    return kick


def main(argv: list[str] | None = None) -> None:
    """Run the four variants and print a table."""
    import xxhash

    args = sys.argv[1:] if argv is None else argv
    nbytes = int(float(args[0]) * 1e9) if args else 500_000_000
    rounds = int(args[1]) if len(args) > 1 else 6
    buf = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    kick = _kicker()
    root = scratch_dir("diag")
    path = root / "f.bin"

    def run(hashing: bool, kicking: bool) -> tuple[float, float]:
        hasher = xxhash.xxh3_128()
        view = memoryview(buf)
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            fd = f.fileno()
            for offset in range(0, len(view), CHUNK):
                piece = view[offset : offset + CHUNK]
                if hashing:
                    hasher.update(piece)
                f.write(piece)
                if kicking and kick is not None:
                    kick(fd, offset, len(piece))
            written = time.perf_counter()
            os.fsync(fd)
        return written - start, time.perf_counter() - written

    variants = {
        "raw": (False, False),
        "raw+hash": (True, False),
        "raw+kick": (False, True),
        "raw+hash+kick": (True, True),
    }
    names = list(variants)
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % 4 :] + names[: r % 4]:
            rmtree(path)
            os.sync()
            results[name].append(run(*variants[name]))
    rmtree(root)
    hasher = xxhash.xxh3_128()
    start = time.perf_counter()
    hasher.update(buf)
    hash_s = time.perf_counter() - start
    print(f"{len(buf) / 1e9:.2f} GB, {rounds} rounds; XXH3-128 alone: {hash_s:.3f} s")
    if kick is None:
        print("sync_file_range unavailable here: the +kick rows equal the others")
    print(f"{'variant':15s} {'best':>7s} {'(write':>7s} {'+ fsync)':>8s} {'median':>7s}")
    for name, runs in results.items():
        best = min(runs, key=sum)
        print(
            f"{name:15s} {sum(best):7.3f} {best[0]:7.3f} {best[1]:8.3f} "
            f"{median([sum(x) for x in runs]):7.3f}"
        )


if __name__ == "__main__":
    main()
