"""One exit drain for what accelkit delivers in the background, in a fixed order.

At interpreter exit three things may still be on their way: an asynchronous save in flight,
committed checkpoints waiting for the remote tier, values and checkpoint events waiting for the
trackers. Each must finish before the next starts, because each feeds the next: a save that
commits during the exit queues its checkpoint for replication, and both report to the trackers.
Registered separately (as they were), the hooks ran in reverse order of registration: the
replication drain, registered at the run's first save, ran before the hook that waits for the
save in flight, and a checkpoint committed in the last second of a run never reached the remote
tier, without a word.

So every such drain registers here, under its phase (:data:`SAVES`, then :data:`REPLICATION`,
then :data:`TRACKERS`); one trampoline, registered with threading's exit hooks, runs them in
phase order (in order of registration within a phase). Threading's hooks run at the start of
interpreter shutdown, while daemon threads (the workers and the replicator) still run, and
before ``atexit``'s (so a tracker's backend still has its own exit hook ahead, wandb's service
among them); being registered after :mod:`concurrent.futures`, the trampoline also runs before
its thread pools stop taking work (fsspec's event loop resolves names in one; some tracker
clients send from one). A library that imports :mod:`concurrent.futures` later registers its
hook after ours: :func:`move_last` registers the trampoline again (the tracker hub calls it when
a backend's ``start()`` returns).

A drain that raises is logged and the next one runs. A drain registered while the others run
(a save that commits during the exit starts the remote tier's replicator) still runs, in its
phase's turn.

Public API: :func:`at_exit`, :class:`ExitHook`, :func:`move_last`, :data:`SAVES`,
:data:`REPLICATION`, :data:`TRACKERS`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
from collections.abc import Callable

from accelkit.errors import ConfigurationError

__all__ = ["REPLICATION", "SAVES", "TRACKERS", "ExitHook", "at_exit", "move_last"]

logger = logging.getLogger(__name__)

SAVES = 0
"""The saves in flight commit (or fail)."""
REPLICATION = 1
"""The committed checkpoints reach the remote tier, up to its deadline."""
TRACKERS = 2
"""The values and checkpoint events reach the trackers, and their runs finish."""

_lock = threading.Lock()
_hooks: list[ExitHook] = []
_order = itertools.count()
_state = {"running": False, "done": False}


class ExitHook:
    """A drain registered with :func:`at_exit`.

    Attributes:
        phase: :data:`SAVES`, :data:`REPLICATION` or :data:`TRACKERS`.
        name: what the drain is, for the log line of a failure.
    """

    def __init__(self, callback: Callable[[], None], phase: int, name: str) -> None:
        self.callback: Callable[[], None] | None = callback
        self.phase = phase
        self.name = name
        self.seq = next(_order)

    def cancel(self) -> None:
        """Do not run it at exit (the drain already ran, from ``end_training()`` or
        ``finish()``); releases the callback and what it holds."""
        with _lock:
            self.callback = None
            if self in _hooks:
                _hooks.remove(self)


def at_exit(callback: Callable[[], None], phase: int, name: str = "") -> ExitHook:
    """Run ``callback`` at interpreter exit, in ``phase``'s turn (see the module docstring).

    Args:
        callback: the drain; it bounds its own wait (a deadline), since nothing after it runs
            until it returns.
        phase: :data:`SAVES`, :data:`REPLICATION` or :data:`TRACKERS`.
        name: what it is, for the log line if it raises (default: the callback's name).

    Returns:
        The registration; :meth:`ExitHook.cancel` takes it back.
    """
    if phase not in (SAVES, REPLICATION, TRACKERS):
        raise ConfigurationError(
            f"phase={phase!r}: expected SAVES, REPLICATION or TRACKERS of accelkit.delivery.exit."
        )
    hook = ExitHook(callback, phase, name or getattr(callback, "__qualname__", repr(callback)))
    with _lock:
        _hooks.append(hook)
    move_last()  # behind the hooks registered since the last registration
    return hook


def move_last() -> None:
    """Register the trampoline again, so that it runs before the exit hooks registered since
    (threading runs its hooks last in, first out; the trampoline runs its drains once)."""
    with _lock:
        if _state["running"] or _state["done"]:
            return
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:  # pragma: no cover - CPython has had it since 3.9
            atexit.register(_run)
        else:
            register(_run)
    except RuntimeError:  # the interpreter is already shutting down: _run is on its way
        pass


def _next() -> ExitHook | None:
    with _lock:
        if not _hooks:
            return None
        hook = min(_hooks, key=lambda h: (h.phase, h.seq))
        _hooks.remove(hook)
        return hook


def _run() -> None:
    """The trampoline: every registered drain, in phase order, once."""
    with _lock:
        if _state["running"] or _state["done"]:
            return
        _state["running"] = True
    try:
        while (hook := _next()) is not None:
            callback, hook.callback = hook.callback, None
            if callback is None:
                continue
            try:
                callback()
            except Exception:  # one drain's failure never stops the next one
                logger.warning("At exit, %s failed:", hook.name, exc_info=True)
    finally:
        with _lock:
            _state["running"] = False
            _state["done"] = True
