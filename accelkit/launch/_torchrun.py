"""``python -m accelkit.launch._torchrun ARGS``: torchrun (``torch.distributed.run``) as the
child of ``accelkit launch``.

This runs torchrun's own ``main`` unchanged, with one difference: when a signal stops the job,
torchrun's agent stops the workers and then re-raises ``SignalException``, which would print some
twenty lines of traceback. Here that one exception ends the process with ``128 + signal``, and
``accelkit launch`` reports the stop in one line (see :mod:`accelkit.launch.signals`). A failed
worker's ``ChildFailedError`` likewise ends it with torchrun's report alone (no stack of torchrun's
own), the first failure written for the launcher's last line (:mod:`accelkit.launch._failure`),
and the failed worker's exit code.

Before anything else, torchrun arms its death signal (it dies with the launcher, even a SIGKILLed
one) and announces its own pid to the workers, which arm theirs against it.

Two more differences, for preemption (``docs/guides/preemption.md``):

* SIGUSR1 and SIGUSR2 do not kill torchrun's agent (their default action): SLURM's
  ``--signal=USR1@...`` without ``B:`` sends the signal to every process of the job step, the
  agent included, and the workers are the ones to act on it. The agent's handler does nothing,
  and the workers start with the default action (a caught signal's handler does not survive
  ``exec``), so a script that does not catch it is stopped by it as before.
* A worker group that exited because of a preemption (every failed worker exited with the
  code the job's main process recorded in ``ACCELKIT_PREEMPTION_FILE``) is not restarted, even
  with ``--max_restarts``: a restart would run the job on after its checkpoint, inside a grace
  period that is running out. torchrun stops at once, and the launcher exits with that code.
  torchrun has no public way to say so: this wraps a private method of its agent
  (``LocalElasticAgent._monitor_workers``), only on the torch versions it was checked against
  (:data:`RESTART_RULE_TORCH`, kept true by ``tests/cli/test_torchrun_patch.py``) and only where
  that method has the expected signature. On any other torch, torchrun keeps its own rule (a
  preempted group is restarted while restarts are left), and one line says so.
* A worker group the hang watchdog stopped (the record says ``"reason": "hang"``) *is*
  restarted while restarts are left, in place (one line says so; the record is removed, so
  that the restarted group's own end is reported): its ``load_state()`` resumes from the
  newest memory snapshot (``memory_snapshot_every_steps``) or checkpoint. With no restart
  left it ends the job with the watchdog's code, as before.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from accelkit.launch._failure import ENV_FAILURE_FILE, Failure, error_time_ns, write_failure

#: The torch versions (major, minor), first and last, whose ``LocalElasticAgent`` the
#: no-restart-after-preemption rule was checked against: ``_monitor_workers(self, worker_group)``
#: returns a ``RunResult`` (``state``, ``failures``) that ``SimpleElasticAgent._invoke_run`` reads
#: before it looks at ``_remaining_restarts``. Widen it after running
#: ``tests/cli/test_torchrun_patch.py`` and ``tests/cli/test_launch_preemption.py`` on the new
#: torch.
RESTART_RULE_TORCH = ((2, 4), (2, 13))


def main(argv: Sequence[str]) -> int:
    """Run torchrun with ``argv``; return its exit status (``128 + signal`` when stopped)."""
    from accelkit.launch.signals import ENV_PARENT_PID, die_with_parent

    die_with_parent()
    os.environ[ENV_PARENT_PID] = str(os.getpid())  # the workers' parent: torchrun's agent
    _survive_forwarded_signals()
    _no_restart_after_preemption(argv)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(argv))
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        failure = _first_failure(exc)
        if _preempted(failure.exitcode):
            # Not a failure: the workers committed a preemption checkpoint and chose this
            # code; the launcher says so in one line.
            return failure.exitcode
        hang = _hang_exit(exc.failures)
        if hang is not None:
            # The watchdog stopped the job: a rank that then failed in a collective because a
            # hung peer exited first (its error file is the earliest) is not the cause.
            return hang
        # torchrun's report of every failed rank, without the twenty lines of torchrun's own
        # stack above it; the launcher ends with one line from the failure written here.
        print(_root_cause_first(exc).format_msg(), file=sys.stderr, flush=True)
        path = os.environ.get(ENV_FAILURE_FILE)
        if path:
            write_failure(path, failure)
        return failure.exitcode or 1
    return 0


def _survive_forwarded_signals() -> None:
    """A handler that does nothing for SIGUSR1/SIGUSR2 in torchrun (see the module's
    docstring)."""
    import signal

    from accelkit.launch.signals import FORWARD_SIGNALS

    def ignore(signum: int, frame: Any) -> None:
        pass

    for sig in FORWARD_SIGNALS:
        signal.signal(sig, ignore)


def restart_rule_applies(version: str | None = None) -> str | None:
    """Why the no-restart-after-preemption rule cannot be put into this torch's agent, or
    ``None`` when it can (see the module's docstring).

    Args:
        version: a torch version string (default: the installed torch's).
    """
    import inspect

    import torch
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    version = torch.__version__ if version is None else version
    try:
        major_minor = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = ()
    first, last = RESTART_RULE_TORCH
    if len(major_minor) != 2 or not first <= major_minor <= last:
        return (
            f"torch {version} is not among the versions it was checked against "
            f"({'.'.join(map(str, first))} to {'.'.join(map(str, last))})"
        )
    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    if monitor is None:
        return f"torch {version}'s LocalElasticAgent has no _monitor_workers"
    try:
        names = list(inspect.signature(monitor).parameters)
    except (TypeError, ValueError):
        names = []
    if names != ["self", "worker_group"]:
        return f"torch {version}'s LocalElasticAgent._monitor_workers takes {names}"
    return None


def _no_restart_after_preemption(argv: Sequence[str]) -> bool:
    """Have torchrun's agent leave its restarts unused when the worker group failed because of
    a preemption (see the module's docstring); whether it could.

    torchrun restarts a failed group while ``_remaining_restarts`` is above zero; the check
    runs on each of its monitoring results, before that decision, and sets it to zero.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    why_not = restart_rule_applies()
    if why_not is not None:
        # Restarts stay torchrun's own rule; said only where there are restarts to use.
        if _max_restarts(argv):
            print(
                f"accelkit launch: {why_not}: a worker group that stops for a preemption may "
                "be restarted (--max_restarts) after its checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return False
    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and _group_preempted(result.failures):
            remaining = getattr(self, "_remaining_restarts", 0)
            if remaining and _hang_recorded():
                # Restarted in place: the record would name this hang after a later end.
                _clear_exit_record()
                print(
                    "accelkit launch: the workers stopped for a hang (hang_timeout_seconds) "
                    f"after writing their stacks; restarting them ({remaining} restart(s) "
                    "left): load_state() resumes from the newest memory snapshot or checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
            elif remaining:
                print(
                    "accelkit launch: the workers stopped for a preemption after saving their "
                    f"checkpoint; not restarting them ({remaining} restart(s) left unused)",
                    file=sys.stderr,
                    flush=True,
                )
                self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_workers  # type: ignore[method-assign]
    return True


def _max_restarts(argv: Sequence[str]) -> int:
    """torchrun's ``--max_restarts`` in ``argv`` (0 when absent or unreadable)."""
    for i, arg in enumerate(argv):
        for flag in ("--max_restarts", "--max-restarts"):
            value = None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    return 0
    return 0


def _group_preempted(failures: Any) -> bool:
    """Whether a monitoring result's failures are a preemption exit: some worker exited with the
    recorded preemption exit code and every other one either did too or was stopped by a
    signal (torchrun SIGTERMs the survivors of the first exit). A worker that exited with any
    other code crashed: that is a failure to restart."""
    codes = {int(failure.exitcode) for failure in dict(failures or {}).values()}
    exits = {code for code in codes if code >= 0}
    return len(exits) == 1 and _preempted(exits.pop())


def _hang_recorded() -> bool:
    """Whether the job's exit record says the hang watchdog stopped it (see
    ``docs/guides/watchdog.md``)."""
    record = _exit_record()
    return record is not None and record.get("reason") == "hang"


def _hang_exit(failures: dict[int, Any]) -> int | None:
    """The watchdog's exit code when the job's exit record says it stopped the job and some
    rank exited with that code; None otherwise."""
    record = _exit_record()
    if record is None or record.get("reason") != "hang":
        return None
    code = int(record["exit_code"])
    return code if any(int(f.exitcode) == code for f in dict(failures).values()) else None


def _clear_exit_record() -> None:
    """Remove the job's exit record (a hung group restarted in place: its next end writes its
    own)."""
    from accelkit.runtime.preemption import ENV_PREEMPTION_FILE

    path = os.environ.get(ENV_PREEMPTION_FILE)
    if path:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _exit_record() -> dict[str, Any] | None:
    """The job's exit record (:func:`accelkit.runtime.preemption.read_exit_record`), if any."""
    from accelkit.runtime.preemption import (
        ENV_PREEMPTION_FILE,
        ENV_PREEMPTION_JOB,
        read_exit_record,
    )

    path = os.environ.get(ENV_PREEMPTION_FILE)
    return read_exit_record(path, os.environ.get(ENV_PREEMPTION_JOB)) if path else None


def _preempted(exitcode: int) -> bool:
    """Whether the job's main process recorded a preemption exit with ``exitcode``."""
    record = _exit_record()
    return record is not None and record["exit_code"] == exitcode


def _first_failure(exc: Any) -> Failure:
    """The root cause among the failed ranks of a ``ChildFailedError``: the first to fail.

    A rank that raised wrote an error file with the time it failed: the earliest of those is
    the root cause (a rank whose peer died fails next in a collective, milliseconds later, and
    raises too). Only where no rank raised, one that exited with a code of its own comes
    before one killed by a signal (torchrun SIGTERMs the others after a failure), then the
    earliest as torchrun saw it, then the lowest rank.
    """
    rank, failure = _root_cause(exc.failures)
    raised = error_time_ns(failure.error_file) is not None
    code = int(failure.exitcode)
    if code >= 0:
        exitcode = code
    elif raised:
        # It was on its way out after its exception (exit code 1) when a signal ended it:
        # torchrun stops the other workers once one has exited, and a peer that failed after
        # it may have exited first.
        exitcode = 1
    else:
        exitcode = 128 - code  # a signal, as a shell reports it
    # torch keeps the error file's "message" as it is: a string, or torch's own
    # {"message": "Type: text", "extraInfo": ...} (what accelkit's workers write).
    message: Any = failure.message if raised else ""
    if isinstance(message, dict):
        message = message.get("message", "")
    return Failure(int(rank), exitcode, str(message))


def _root_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The ``(rank, ProcessFailure)`` that failed first (see :func:`_first_failure`)."""

    def key(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, failure = item
        raised_at = error_time_ns(failure.error_file)  # None: no error file
        if raised_at is not None:
            return (0, raised_at, rank)
        # torchrun's timestamp of a failure without an error file is when it noticed it.
        return (1 if failure.exitcode >= 0 else 2, int(failure.timestamp), rank)

    return min(failures.items(), key=key)


def _root_cause_first(exc: Any) -> Any:
    """``exc`` with its root cause (:func:`_root_cause`) first among its failures.

    torchrun's report names as root cause the failure with the smallest timestamp, in whole
    seconds, the first in order among equals: with the root cause first, its report and the
    launcher's last line name the same rank.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    rank, failure = _root_cause(exc.failures)
    others = {r: f for r, f in exc.failures.items() if r != rank}
    try:
        return ChildFailedError(exc.name, {rank: failure, **others})
    except (TypeError, ValueError):  # a torch whose constructor differs: its own report
        return exc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
