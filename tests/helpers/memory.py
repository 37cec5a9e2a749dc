"""A process's own peak memory, for tests that bound what a call costs in a child process."""

from __future__ import annotations

import resource


def peak_kib() -> int:
    """This process's resident-set high-water mark in KiB: ``VmHWM``, which belongs to its own
    address space.

    Not ``ru_maxrss``: Linux keeps the larger of it and the spawning process's across
    ``execve``, so a child of a long pytest session starts at pytest's own peak (1.4 GB in a
    full run), and a growth measured with it reads 0 whatever the call costs.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
