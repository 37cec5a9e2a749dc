"""The watchdog's part of the :class:`~accelkit.Accelerator`: ``hang_timeout_seconds`` and
``not_a_hang()`` (:class:`HangWatch`), ``straggler_fraction`` and ``straggler_steps``
(:class:`StragglerWatch`).

The watchdog itself lives in :mod:`accelkit.runtime.watchdog`; this part connects it to the run
through the hooks the run offers: a hook on the step boundaries (``GradientState.on_boundary``,
one integer increment per boundary) for progress, the checkpointing part's ``run_inside`` (the
clock stops while a save or a load blocks the step), and, when a hang is detected, the run's
trackers (one ``watchdog/hang`` event, then their queues drained for a few seconds) and the
record ``accelkit launch`` reads to pass the exit code through and to name the stack files
(``ACCELKIT_PREEMPTION_FILE``, with ``"reason": "hang"``). See ``docs/guides/watchdog.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from accelkit.runtime.preemption import ENV_PREEMPTION_FILE, write_exit_record
from accelkit.runtime.stragglers import Straggler, StragglerDetector, check_straggler_settings
from accelkit.runtime.watchdog import HangReport, Watchdog, check_hang_timeout

if TYPE_CHECKING:
    from accelkit.checkpointing.config import ProjectConfiguration
    from accelkit.runtime.state import AcceleratorState
    from accelkit.training.optim import GradientState

__all__ = ["HangWatch", "StragglerWatch", "stack_folder"]

logger = logging.getLogger("accelkit.watchdog")

#: How long a hung main process drains its trackers' queues before it exits.
TRACKER_DRAIN_SECONDS = 5.0


def stack_folder(config: ProjectConfiguration) -> str:
    """Where each process writes its stack file on a hang: ``hangs/`` under ``logging_dir``,
    else ``project_dir``, where it is a local folder, else under the current directory."""
    for location in (config.logging_dir, config.project_dir):
        if location and "://" not in str(location):
            return os.path.abspath(os.path.join(str(location), "hangs"))
    return os.path.join(os.getcwd(), "accelkit-hangs")


class HangWatch:
    """``Accelerator(hang_timeout_seconds=)`` for one run (see the module's docstring).

    Args:
        timeout_seconds: ``hang_timeout_seconds`` (``None``: no watchdog; ``not_a_hang()`` is
            then a null context).
        config: the run's configuration (where the stacks go, the exit code).
        state: this process's identity.
        gradient_state: the step state on whose boundaries the watchdog counts progress.
        log: ``Accelerator.log`` (the hang's tracker event, main process).
        finish_trackers: drains the trackers' queues within a number of seconds.
        run_inside: registers a context that every call blocking on checkpoint files runs
            inside (``Checkpointing.run_inside``): the clock stops while ``save_state``,
            ``load_state`` or ``wait_for_checkpoints`` runs, as inside :meth:`not_a_hang`.

    Raises:
        ConfigurationError: ``timeout_seconds`` is not a number of seconds above zero.
    """

    def __init__(
        self,
        timeout_seconds: float | None,
        config: ProjectConfiguration,
        state: AcceleratorState,
        gradient_state: GradientState,
        log: Callable[[dict[str, Any]], None],
        finish_trackers: Callable[[float], object],
        run_inside: Callable[[Callable[[], contextlib.AbstractContextManager[None]]], None],
    ) -> None:
        timeout = check_hang_timeout(timeout_seconds)
        self.state = state
        self.log = log
        self.finish_trackers = finish_trackers
        self.watchdog: Watchdog | None = None
        self._unhook: Callable[[], None] | None = None
        if timeout is None:
            return
        self.watchdog = Watchdog(
            timeout,
            rank=state.process_index,
            world_size=state.num_processes,
            stack_folder=stack_folder(config),
            on_hang=self.hang,
            store=_store(state.num_processes),
            exit_code=config.preemption_exit_code,
        )
        beat = self.watchdog.beat

        def progress(where: str, source: object) -> None:
            beat()

        self._unhook = gradient_state.on_boundary.register(progress)
        run_inside(self.not_a_hang)
        self.watchdog.start()

    @contextlib.contextmanager
    def not_a_hang(self) -> Iterator[None]:
        """Say "not a hang" around a block that may take longer than ``hang_timeout_seconds``
        without a step boundary: a long evaluation, the first compile (``save_state``,
        ``load_state`` and ``wait_for_checkpoints`` need no block: they stop the clock
        themselves). The watchdog's clock stops inside it and starts afresh when it ends.
        Enter it on every process alike (a process that waits in a collective for one inside
        the block is not in one itself).

        Example:
            >>> with accelerator.not_a_hang():
            ...     metrics = evaluate(model, eval_loader)
        """
        if self.watchdog is None:
            yield
            return
        with self.watchdog.not_a_hang():
            yield

    def hang(self, report: HangReport) -> None:
        """The watchdog's ``on_hang``: say it, log the event and drain the trackers (main
        process), and leave the launcher its record (each machine's local main process)."""
        watchdog = self.watchdog
        timeout = 0.0 if watchdog is None else watchdog.timeout_seconds
        logger.error(
            "accelkit: hang: rank %d saw no step progress for %g s (hang_timeout_seconds); rank "
            "%d on %s wrote its Python stacks to %s; exiting with %d (the newest committed "
            "checkpoint is what a restart resumes from)",
            report.detected_by,
            timeout,
            report.rank,
            report.host,
            report.stack_file,
            75 if watchdog is None else watchdog.exit_code,
        )
        if self.state.is_main_process:
            self.log(
                {
                    "watchdog/hang": 1,
                    "watchdog/rank": report.detected_by,
                    "watchdog/stalled_seconds": report.stalled_seconds,
                }
            )
            self.finish_trackers(TRACKER_DRAIN_SECONDS)
        path = os.environ.get(ENV_PREEMPTION_FILE)
        if path and self.state.is_local_main_process and watchdog is not None:
            record = {
                "exit_code": watchdog.exit_code,
                "reason": "hang",
                "rank": report.detected_by,
                "seconds": timeout,
                "stacks": report.stack_folder,
            }
            try:
                write_exit_record(path, record)
            except OSError as exc:
                logger.warning("accelkit: hang: cannot write %s (%s)", path, exc)

    def close(self) -> None:
        """At the end of the run (``end_training``): stop watching."""
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        if self.watchdog is not None:
            self.watchdog.close()


def _store(world_size: int) -> Any:
    """The default process group's store (how a hang reaches the other processes without a
    collective); ``None`` on one process or where torch offers none."""
    if world_size <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


class StragglerWatch:
    """``Accelerator(straggler_fraction=, straggler_steps=)`` for one run: the detector of
    :mod:`accelkit.runtime.stragglers`, whose times ride on the preemption part's agreement
    (:attr:`rider`), and its report (a warning naming the rank and its host, and a
    ``straggler/*`` tracker event, from the main process).

    Args:
        fraction: how much slower than the others' median counts (``None``: no report).
        steps: over how many optimizer steps.
        state: this process's identity.
        backward_seconds: turns the timing of ``backward()`` on and returns its reader.
        log: ``Accelerator.log``.

    Raises:
        ConfigurationError: a setting the report cannot use.
    """

    def __init__(
        self,
        fraction: float | None,
        steps: int,
        state: AcceleratorState,
        backward_seconds: Callable[[], Callable[[], float]],
        log: Callable[[dict[str, Any]], None],
    ) -> None:
        check_straggler_settings(fraction, steps)
        self.state = state
        self.log = log
        self.rider: StragglerDetector | None = None
        self.hosts: list[str] = []
        if fraction is None or state.num_processes <= 1:
            return
        self.hosts = _hosts(state.num_processes)
        self.rider = StragglerDetector(
            rank=state.process_index,
            world_size=state.num_processes,
            fraction=float(fraction),
            steps=steps,
            waiting=backward_seconds(),
            report=self.report,
        )

    def report(self, straggler: Straggler) -> None:
        """Say it once (main process): a warning and a tracker event naming rank and host."""
        if not self.state.is_main_process:
            return
        host = self.hosts[straggler.rank] if straggler.rank < len(self.hosts) else "?"
        logger.warning(
            "accelkit: straggler: rank %d on %s took %.3f s per step on its own (outside "
            "backward) over the last %d optimizer steps, against a median of %.3f s for the "
            "other ranks; every rank waits for it at each step",
            straggler.rank,
            host,
            straggler.step_seconds,
            straggler.steps,
            straggler.median_seconds,
        )
        self.log(
            {
                "straggler/rank": straggler.rank,
                "straggler/host": host,
                "straggler/step_seconds": round(straggler.step_seconds, 6),
                "straggler/median_seconds": round(straggler.median_seconds, 6),
            }
        )


def _hosts(world_size: int) -> list[str]:
    """Every rank's host name, gathered once when the run starts (not per step)."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        return [socket.gethostname()] * world_size
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return [str(host) for host in hosts]
