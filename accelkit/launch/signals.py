"""Stopping a launched job: ``accelkit launch`` hands a stop signal on to torchrun, exactly once.

torchrun's elastic agent is built to be stopped by its parent: SIGTERM, SIGINT, SIGHUP and SIGQUIT
become a ``SignalException`` in the agent, which sends the signal to every worker's process group,
waits up to its shutdown timeout (30 s) and then SIGKILLs what is left. ``accelkit launch`` only
has to deliver the signal, once, and wait:

* The child (torchrun, or the script itself for one local process) starts in a session of its
  own, so Ctrl-C, which the terminal sends to the whole foreground process group, reaches the
  launcher alone. The launcher forwards it, and the agent never gets a second signal in the
  middle of its shutdown (a second ``SignalException`` there would abandon the workers).
* Whatever stopped the launcher, the child gets SIGTERM: the signal schedulers send, one signal
  for a script to handle if it wants to save on the way out, and no ``KeyboardInterrupt``
  traceback from every rank.
* The launcher waits for the child, bounded: past torchrun's own shutdown timeout (plus a margin),
  or at a second signal, it SIGKILLs the process groups of the child's children (the workers,
  which torchrun starts in sessions of their own) and the child's.
* It then exits with ``128 + signal``, as a shell reports a process stopped by that signal, after
  one line saying so. A checkpoint's manifest is written last, so a worker stopped at any moment
  leaves the last committed checkpoint loadable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType

__all__ = ["STOP_SIGNALS", "TORCHRUN_SHUTDOWN_S", "run_child"]

# The signals torchrun's agent handles by default (TORCHELASTIC_SIGNALS_TO_HANDLE).
STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)
# torchrun's LocalElasticAgent(shutdown_timeout=30): how long it waits for its workers to stop
# before it SIGKILLs them. The launcher gives it that long and a margin before stepping in.
TORCHRUN_SHUTDOWN_S = 30.0
_MARGIN_S = 10.0


def _say(message: str) -> None:
    print(f"accelkit launch: {message}", file=sys.stderr, flush=True)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _child_process_groups(pid: int) -> list[int]:
    """Process groups of ``pid``'s children, read from ``/proc`` (empty where there is none)."""
    groups: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return groups
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command name, which is in parentheses and may contain anything.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[1] == str(pid):
            groups.append(int(fields[2]))
    return groups


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _StopForwarder:
    """Signal handler state: the first stop signal forwards SIGTERM, a second one (or the
    deadline) kills."""

    def __init__(self, what: str, grace_s: float) -> None:
        self.what = what
        self.grace_s = grace_s
        self.signum: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._killed = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            _say(
                f"{_name(signum)}: stopping {self.what} with SIGTERM; SIGKILL in "
                f"{self.grace_s:g} s or at the next signal"
            )
            self._terminate()
        else:
            _say(f"{_name(signum)} again: killing {self.what} now")
            self.kill()

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        if self.signum is not None:  # the signal came while the child was being started
            self._terminate()

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        if self._timer is None:
            self._timer = threading.Timer(self.grace_s, self._deadline)
            self._timer.daemon = True
            self._timer.start()

    def _deadline(self) -> None:
        _say(f"{self.what} still running {self.grace_s:g} s after SIGTERM: killing it")
        self.kill()

    def kill(self) -> None:
        """SIGKILL the child's children's process groups, then the child's own."""
        with self._lock:
            proc = self._proc
            if self._killed or proc is None or proc.returncode is not None:
                return
            self._killed = True
            # Children first: once the child is gone they are reparented and cannot be found.
            for pgid in _child_process_groups(proc.pid):
                if pgid != os.getpgrp():
                    _signal_group(pgid, signal.SIGKILL)
            _signal_group(proc.pid, signal.SIGKILL)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def run_child(cmd: Sequence[str], env: dict[str, str], what: str, *, via_torchrun: bool) -> int:
    """Run ``cmd`` to its end, stopping it as described in this module when the launcher is
    signalled.

    Args:
        cmd: the command (torchrun, or the script for one local process).
        env: its environment.
        what: how the one-line messages name the job, e.g. ``"2 workers (torchrun pid 7)"``.
        via_torchrun: the child is torchrun, which needs its own shutdown timeout before the
            launcher steps in.

    Returns:
        The child's exit code, or ``128 + signal`` when a signal stopped the job.
    """
    grace = TORCHRUN_SHUTDOWN_S + _MARGIN_S if via_torchrun else TORCHRUN_SHUTDOWN_S
    stop = _StopForwarder(what, grace)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {sig: signal.signal(sig, stop.on_signal) for sig in STOP_SIGNALS} if in_main_thread else {}
    )
    try:
        proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
        stop.attach(proc)
        returncode = proc.wait()
    finally:
        stop.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.signum is None:
        return returncode
    code = 128 + stop.signum
    _say(f"stopped by {_name(stop.signum)}; exit code {code}")
    return code
