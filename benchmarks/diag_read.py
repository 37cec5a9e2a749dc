"""Diagnosis: how fast this disk gives back N bytes from a cold cache (not part of the run).

``python -m benchmarks.diag_read [GB] [rounds]`` (root: it drops the page cache before every
read) writes one file of N bytes, then reads it back cold, alternating, seven ways:

- ``buffered``: one thread, 8 MiB ``pread`` calls through the page cache (what "raw read" is in
  ``bench_save_load``);
- ``direct xT, N MiB``: ``O_DIRECT`` reads of N MiB (1 or 8) into one aligned buffer by T
  threads at once (1, 4, 8): the deeper the queue, the nearer the device's own limit (on the
  VM this was written on, 1 MiB requests from 4-8 threads beat 8 MiB ones by about 10%).

The fastest of them is what no load of the same bytes can beat on this disk: use it to tell
whether a load target stated against another tool (e.g. "1.5x faster than Accelerate's cold
load") is reachable at all here.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import median, rmtree, scratch_dir

CHUNK = 8 << 20


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _buffered(path: str, view: memoryview) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        began = time.perf_counter()
        offset = 0
        while offset < len(view):
            got = os.preadv(fd, [view[offset : offset + CHUNK]], offset)
            if not got:
                break
            offset += got
        return time.perf_counter() - began
    finally:
        os.close(fd)


def _direct(threads: int, request: int) -> Callable[[str, memoryview], float]:
    def read(path: str, view: memoryview) -> float:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            began = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                offsets = range(0, len(view), request)
                list(pool.map(lambda o: os.preadv(fd, [view[o : o + request]], o), offsets))
            return time.perf_counter() - began
        finally:
            os.close(fd)

    return read


def main(argv: list[str] | None = None) -> None:
    """Write the file, read it back cold every way, print the best and median GB/s."""
    args = sys.argv[1:] if argv is None else argv
    size = int(float(args[0]) * 1e9) // CHUNK * CHUNK if args else 1 << 30
    rounds = int(args[1]) if len(args) > 1 else 5
    folder = scratch_dir("accelkit-diag-read-")
    path = str(folder / "data.bin")
    buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    try:
        block = os.urandom(CHUNK)
        with open(path, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(block)
            os.fsync(f.fileno())
        for offset in range(0, size, mmap.PAGESIZE):  # fault the buffer in before timing
            buffer[offset] = 0
        ways: dict[str, Callable[[str, memoryview], float]] = {"buffered": _buffered}
        ways.update(
            {
                f"direct x{t}, {request >> 20} MiB": _direct(t, request)
                for t in (1, 4, 8)
                for request in (1 << 20, CHUNK)
            }
        )
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                _drop_caches()
                times[name].append(ways[name](path, view))
        print(f"cold reads of {size / 1e9:.2f} GB, {rounds} rounds, alternating:")
        for name, seconds in times.items():
            best, mid = min(seconds), median(seconds)
            print(f"  {name:18s} best {best:.3f} s ({size / best / 1e9:.2f} GB/s), "
                  f"median {mid:.3f} s ({size / mid / 1e9:.2f} GB/s)")  # fmt: skip
    finally:
        view.release()
        buffer.close()
        rmtree(folder)


if __name__ == "__main__":
    main()
