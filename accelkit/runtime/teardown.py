"""Leaving a distributed run at interpreter exit without torch's teardown abort.

torch's gloo process group runs every collective on its own C++ worker threads
(``pt_gloo_runloop``). The worker that finishes a collective drops its reference to the
collective's work a moment after the caller was told it is done; when that reference is the last
one and the work holds tensors that Python created and already let go of, dropping it takes the
GIL. If the interpreter has begun to finalize by then, CPython ends the thread with
``pthread_exit``, whose unwinding through torch's C++ destructors calls ``std::terminate``: the
process prints "terminate called without an active exception" and dies of SIGABRT, after the
script did all its work, and the launcher reports the run as failed.

The window is the few milliseconds between a script's last collective (typically
``wait_for_everyone()``) and finalization, during which the main thread keeps the GIL: a worker
asks for it, and is granted it only after the switch interval (5 ms by default), too late.
About one two-process run in 40-60 hit it on a 2-core machine; a script that raises
:func:`sys.setswitchinterval` hits it in more than a third of its runs. Destroying the process
group does not help: the group lives on while anything holds it (a ``DistributedDataParallel``
module does), and so do its threads.

:func:`settle_collective_threads` closes the window: at exit, the main thread sleeps (so the GIL
is free) until every gloo worker has been asleep for several polls in a row, i.e. has finished
with its last work and waits for the next.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["settle_collective_threads"]

# The names torch's gloo backend gives its worker threads (see /proc/self/task/*/comm).
_WORKER_NAMES = frozenset({"pt_gloo_runloop"})
_TASKS = "/proc/self/task"


def _worker_states() -> list[str] | None:
    """The scheduler state letter of each gloo worker thread of this process, or None where
    threads cannot be read (not Linux)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as stat:
                line = stat.read()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (name) S ...": the name may hold spaces and ')', so cut at the first '(' and
        # the last ')'.
        name, _, rest = line.partition("(")[2].rpartition(")")
        if name in _WORKER_NAMES and rest.split():
            states.append(rest.split()[0])
    return states


def settle_collective_threads(
    timeout_s: float = 2.0, quiet_polls: int = 5, poll_s: float = 0.002
) -> bool:
    """Wait, with the GIL released, until the gloo worker threads are done with their last work.

    Called at interpreter exit, after the process group is destroyed (see the module's
    docstring for why). A worker counts as done when it is asleep (state ``S``) in
    ``quiet_polls`` polls in a row; one that runs, or waits to run, resets the count. With no
    gloo threads, or where threads cannot be read, it returns at once.

    Args:
        timeout_s: the most seconds to wait (a worker blocked on a peer that never answers
            must not hold the exit up).
        quiet_polls: how many polls in a row every worker must be asleep.
        poll_s: seconds between polls.

    Returns:
        ``True`` once the workers are settled (or there are none), ``False`` at the timeout.
    """
    states = _worker_states()
    if not states:
        return True
    # A worker waiting for the GIL gets it at once while this thread sleeps, unless another
    # Python thread holds it; a short switch interval makes that one hand it over quickly too.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 0.001))
    try:
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while quiet < quiet_polls:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
            states = _worker_states() or []
            quiet = quiet + 1 if all(state == "S" for state in states) else 0
        return True
    finally:
        sys.setswitchinterval(interval)
