"""``debug_launcher``: run a function on several CPU processes to debug distributed code."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["debug_launcher"]


def debug_launcher(
    function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2
) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU processes (gloo on 127.0.0.1).

    Meant for debugging and tests on a machine without GPUs: the processes are forked from
    this one, as with :func:`~accelkit.notebook_launcher` ``(cpu=True)``.

    Args:
        function: the function each process runs.
        args: its positional arguments.
        num_processes: how many processes (default 2).

    Raises:
        ValueError: for ``num_processes < 1``.
    """
    from accelkit.launch.launcher import notebook_launcher

    notebook_launcher(function, args=args, num_processes=num_processes, cpu=True)
