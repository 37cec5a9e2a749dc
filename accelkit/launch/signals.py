"""Stopping a launched job: ``accelkit launch`` hands a stop signal on to torchrun, exactly once,
and no process of the job outlives the launcher.

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
  one line saying so; unless the workers caught SIGTERM as a preemption signal
  (``ProjectConfiguration(preemption_signals=...)``), committed a checkpoint and exited with
  ``preemption_exit_code``: the launcher then exits with that code (they record it in the file
  named by ``ACCELKIT_PREEMPTION_FILE``), the same code as when a worker got the signal
  itself. A checkpoint's manifest is written last, so a worker stopped at any moment leaves
  the last committed checkpoint loadable.

Signal handlers only record: the handler appends the signal number to a queue and
``signal.set_wakeup_fd`` wakes the launcher's loop, which does the forwarding, the printing and the
escalation. A handler that printed, scanned ``/proc`` or took a lock could be re-entered by the
next signal of a burst and deadlock (a lock held by the interrupted frame) or raise (a re-entrant
write to ``stderr``); with this split, any number of signals in any order ends the same way.

A launcher that cannot forward anything (SIGKILLed, or killed by the OOM killer) must not leave
its job running and saving. Every link of the chain launcher -> torchrun -> workers asks Linux to
SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``), set by the process itself as its
first act, before any of the user's code runs: torchrun in :mod:`accelkit.launch._torchrun`, a
worker (or the one local process) in the small start-up step :func:`exec_guarded`, which then
``exec``\\ s the script in the same process (the death signal survives ``exec``). A parent that died
before the request was made is caught by comparing ``getppid()`` with the pid the parent announced
in ``ACCELKIT_LAUNCH_PARENT_PID``. The death signal is SIGKILL, not SIGTERM: with its parent gone
nothing coordinates a clean stop (a worker saving on SIGTERM would wait forever in a collective with
peers that are dying too), and the commit protocol keeps the last committed checkpoint whole
whatever moment the kill lands.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from accelkit.runtime.preemption import signal_name

__all__ = [
    "ENV_PARENT_PID",
    "FORWARD_SIGNALS",
    "STOP_SIGNALS",
    "TORCHRUN_SHUTDOWN_S",
    "die_with_parent",
    "exec_guarded",
    "guarded_command",
    "hold_stop_signals",
    "ignore_stop_signals",
    "run_child",
]

# The signals torchrun's agent handles by default (TORCHELASTIC_SIGNALS_TO_HANDLE).
STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)
# Signals handed on to every worker as they are, without stopping anything: SLURM's
# ``--signal=USR1@120`` warning (``B:`` sends it to the batch shell, where the launcher runs;
# without it, to every process of the job step), which a script with
# ``preemption_signals=("SIGUSR1", ...)`` turns into a checkpoint and its own exit.
FORWARD_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)
# torchrun's LocalElasticAgent(shutdown_timeout=30): how long it waits for its workers to stop
# before it SIGKILLs them. The launcher gives it that long and a margin before stepping in.
TORCHRUN_SHUTDOWN_S = 30.0
_MARGIN_S = 10.0
# The pid of the process a launched process must die with (its parent at start).
ENV_PARENT_PID = "ACCELKIT_LAUNCH_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _say(message: str) -> None:
    print(f"accelkit launch: {message}", file=sys.stderr, flush=True)


def die_with_parent() -> bool:
    """Have Linux SIGKILL this process when its parent dies; die now if it already has.

    The parent is the pid in ``ACCELKIT_LAUNCH_PARENT_PID`` (set by whoever started this
    process); without it, nothing is done. The request is made before the check, so a parent
    dying in between is caught by one or the other.

    Returns:
        Whether the death signal is armed (False off Linux or without the variable).
    """
    expected = os.environ.get(ENV_PARENT_PID, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != int(expected):
        # The parent died before the request: this process is already an orphan.
        os.kill(os.getpid(), signal.SIGKILL)
    return armed


# `python -c` code that runs exec_guarded. It starts with "-" so that torchrun, which names a
# worker by the first of its arguments not starting with "-", names it by the script as usual.
_GUARD_CODE = "-1; from accelkit.launch.signals import exec_guarded; exec_guarded()"


# `python -c` code that runs a script or module as python would, recording its exception.
_RUN_CODE = (
    "import sys; from accelkit.launch._failure import run_script; "
    "run_script(sys.argv[1], sys.argv[2], sys.argv[3:])"
)


def guarded_command(python: str, script: str, args: Sequence[str], mode: str) -> list[str]:
    """The command that runs ``script`` as a process that dies with its parent.

    Args:
        python: the interpreter that runs the start-up step.
        script: the script, module (``mode="module"``) or executable (``mode="exec"``).
        args: the script's arguments.
        mode: ``"python"`` (``python -u script``), ``"module"`` (``python -u -m script``) or
            ``"exec"`` (the script is an executable).

    Returns:
        ``[python, "-c", ..., "--<mode>", script, *args]``, which :func:`exec_guarded` runs.
    """
    return [python, "-c", _GUARD_CODE, f"--{mode}", script, *args]


def exec_guarded(argv: Sequence[str] | None = None) -> None:
    r"""Arm the death signal (:func:`die_with_parent`), then ``exec`` the script in this process.

    A Python script or module runs through :func:`accelkit.launch._failure.run_script` (in a
    ``python -u`` process, as torchrun would start it), which records an uncaught exception for
    the launcher's summary line; an executable (``--no_python``) is ``exec``\ d as it is.

    Args:
        argv: ``["--python"|"--module"|"--exec", script, *args]`` (default: ``sys.argv[1:]``).
    """
    mode, script, *args = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()
    os.environ.pop(ENV_PARENT_PID, None)  # the script's own children are not ours to guard
    python = os.environ.get("PYTHON_EXEC", sys.executable)  # as torchrun picks it
    if mode in ("--python", "--module"):
        # python -u, running the script or module through accelkit.launch._failure, which
        # records an uncaught exception for the launcher's last line.
        cmd = [python, "-u", "-c", _RUN_CODE, mode, script, *args]
    else:
        cmd = [script, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"accelkit launch: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)


def _children(pid: int) -> list[tuple[int, int]]:
    """``(pid, process group)`` of ``pid``'s children, read from ``/proc`` (empty where there is
    none)."""
    found: list[tuple[int, int]] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
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
            found.append((int(entry), int(fields[2])))
    return found


def _child_process_groups(pid: int) -> list[int]:
    """Process groups of ``pid``'s children, read from ``/proc`` (empty where there is none)."""
    return [group for _, group in _children(pid)]


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Stopper:
    """What the launcher's loop does about stop signals: the first forwards SIGTERM, a second one
    (or the deadline) kills. Called from the loop only, never from a signal handler."""

    def __init__(
        self, proc: subprocess.Popen[bytes], what: str, grace_s: float, via_torchrun: bool
    ) -> None:
        self.proc = proc
        self.what = what
        self.grace_s = grace_s
        self.via_torchrun = via_torchrun
        self.signum: int | None = None
        self.deadline: float | None = None
        self.killed = False

    def forward(self, signum: int) -> None:
        """Hand ``signum`` (one of :data:`FORWARD_SIGNALS`) on to every worker process itself:
        torchrun's children (not torchrun, not the workers' own children such as dataloader
        workers, which the default action would kill), or the one local process."""
        if self.proc.poll() is not None:
            return
        if self.via_torchrun:
            pids = [pid for pid, _ in _children(self.proc.pid)]
        else:
            pids = [self.proc.pid]
        sent = 0
        for pid in pids:
            try:
                os.kill(pid, signum)
                sent += 1
            except (ProcessLookupError, PermissionError):
                pass
        _say(f"{signal_name(signum)}: forwarded to {sent} worker process(es)")

    def on_signal(self, signum: int) -> None:
        if signum in FORWARD_SIGNALS:
            self.forward(signum)
            return
        if self.signum is None:
            self.signum = signum
            _say(
                f"{signal_name(signum)}: stopping {self.what} with SIGTERM; SIGKILL in "
                f"{self.grace_s:g} s or at the next signal"
            )
            if self.proc.poll() is None:
                # torchrun starts each worker in a session of its own and stops them one after
                # the other: the second would see the first one's connection drop and fail with
                # a traceback before its turn. Every worker gets SIGTERM now, as a foreground
                # job's process group gets Ctrl-C, then torchrun.
                for pgid in _child_process_groups(self.proc.pid):
                    if pgid != os.getpgrp():
                        _signal_group(pgid, signal.SIGTERM)
                _signal_group(self.proc.pid, signal.SIGTERM)
            self.deadline = time.monotonic() + self.grace_s
        elif not self.killed:
            _say(f"{signal_name(signum)} again: killing {self.what} now")
            self.kill()
        # Later signals of a burst change nothing: the job is being killed already.

    def check_deadline(self) -> None:
        if self.deadline is not None and not self.killed and time.monotonic() >= self.deadline:
            _say(f"{self.what} still running {self.grace_s:g} s after SIGTERM: killing it")
            self.kill()

    def kill(self) -> None:
        """SIGKILL the child's children's process groups, then the child's own."""
        self.killed = True
        if self.proc.poll() is not None:
            return
        # Children first: once the child is gone they are reparented and cannot be found.
        for pgid in _child_process_groups(self.proc.pid):
            if pgid != os.getpgrp():
                _signal_group(pgid, signal.SIGKILL)
        _signal_group(self.proc.pid, signal.SIGKILL)


class _Recorder:
    """The launcher's only signal handler: it appends the signal to ``pending`` and, through
    ``signal.set_wakeup_fd``, makes ``wake_r`` readable; the loop does the rest."""

    def __init__(self) -> None:
        self.pending: deque[int] = deque()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self._previous: dict[int, Any] = {}
        self._previous_wakeup = -1

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)  # only this: see the module's docstring

    def install(self) -> None:
        self._previous_wakeup = signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        self._previous = {
            sig: signal.signal(sig, self._record) for sig in (*STOP_SIGNALS, *FORWARD_SIGNALS)
        }

    def drain(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous:
            signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self.wake_r)
        os.close(self.wake_w)


_held: _Recorder | None = None


def hold_stop_signals() -> None:
    """Record stop signals from now until this process exits (the ``accelkit launch`` command).

    :func:`run_child` then sees a signal that came before the job started (and does not start
    it), and the tail of a burst that comes after the job ended finds a handler that records it,
    not the default one (which would kill the launcher, or raise ``KeyboardInterrupt``, with a
    different status than the one the first signal decided). Call it from the main thread of a
    process that ends after the launch; without it, :func:`run_child` installs the handler for
    the job's lifetime and restores the previous ones afterwards.
    """
    global _held
    if _held is None and threading.current_thread() is threading.main_thread():
        _held = _Recorder()
        _held.install()


def ignore_stop_signals() -> None:
    """Ignore stop signals from now on: for the ``accelkit launch`` process, once its job is over.

    Python puts the default handlers back while the interpreter shuts down, so the tail of a
    burst would otherwise kill the launcher on its way out, with another status than the one it
    chose (or, for SIGINT, with a traceback). Ignored signals stay ignored through shutdown.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in (*STOP_SIGNALS, *FORWARD_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def run_child(
    cmd: Sequence[str],
    env: dict[str, str],
    what: str,
    *,
    via_torchrun: bool,
    on_failure: Callable[[int], None] | None = None,
    preempted: Callable[[], int | None] | None = None,
    stopped_because: Callable[[], str | None] | None = None,
) -> int:
    """Run ``cmd`` to its end, stopping it as described in this module when the launcher is
    signalled.

    Args:
        cmd: the command (torchrun, or the script for one local process). It learns the
            launcher's pid from ``ACCELKIT_LAUNCH_PARENT_PID`` (see :func:`die_with_parent`).
        env: its environment.
        what: how the one-line messages name the job, e.g. ``"2 workers (torchrun pid 7)"``.
        via_torchrun: the child is torchrun, which needs its own shutdown timeout before the
            launcher steps in.
        on_failure: called with the exit code when the child failed on its own (not stopped
            by the launcher), last: for a summary line after everything the job printed.
        preempted: the exit code the job's workers chose after committing a preemption
            checkpoint (``ProjectConfiguration.preemption_exit_code``), ``None`` if they did not.
        stopped_because: why the workers chose that code, when it was not a preemption (the
            hang watchdog: which rank, where the stacks are); ``None``: a preemption.

    Returns:
        The child's exit code, or ``128 + signal`` when a signal stopped the job; when the job
        stopped for a preemption after committing its checkpoint (the launcher's forwarded
        SIGTERM, or a signal a worker got directly), the preemption exit code.
    """
    grace = TORCHRUN_SHUTDOWN_S + _MARGIN_S if via_torchrun else TORCHRUN_SHUTDOWN_S
    recorder, own = _held, _held is None
    if recorder is None:
        recorder = _Recorder()
        if threading.current_thread() is threading.main_thread():
            recorder.install()
    exited: int | None = None
    try:
        for sig in [sig for sig in recorder.pending if sig in FORWARD_SIGNALS]:
            # Nothing to hand it on to yet (and nothing to save): it is dropped.
            recorder.pending.remove(sig)
            _say(f"{signal_name(sig)} before {what} started: no worker to forward it to; ignored")
        if recorder.pending:  # stopped before the job started: do not start it
            first = recorder.pending[0]
            _say(
                f"{signal_name(first)} before {what} started; not starting it; "
                f"exit code {128 + first}"
            )
            return 128 + first
        proc = subprocess.Popen(
            list(cmd), env={**env, ENV_PARENT_PID: str(os.getpid())}, start_new_session=True
        )
        stop = _Stopper(proc, what, grace, via_torchrun)
        exited = _pidfd(proc.pid)
        watched = [recorder.wake_r] if exited is None else [recorder.wake_r, exited]
        while True:
            while recorder.pending:
                stop.on_signal(recorder.pending.popleft())
            if proc.poll() is not None:
                break
            stop.check_deadline()
            # Without a pidfd the child's exit is seen by polling, a few times a second.
            timeout = 0.2 if exited is None else 5.0
            if stop.deadline is not None and not stop.killed:
                timeout = max(0.0, min(timeout, stop.deadline - time.monotonic()))
            select.select(watched, [], [], timeout)
            recorder.drain()
        returncode = proc.returncode
    finally:
        if own:
            recorder.restore()
        if exited is not None:
            os.close(exited)
    saved = None if preempted is None else preempted()
    if stop.signum is None:
        # A child killed by a signal (the OOM killer, a SIGKILL to torchrun) exits the launcher
        # as a shell reports it, 128 + signal, rather than Python's 256 - signal.
        code = 128 - returncode if returncode < 0 else returncode
        if saved is not None and code == saved:
            because = None if stopped_because is None else stopped_because()
            if because is not None:
                _say(f"{because}; exit code {code}")
            else:
                _say(
                    "the job stopped for a preemption after saving its checkpoint; "
                    f"exit code {code}"
                )
            return code
        if code and on_failure is not None:
            on_failure(code)
        return code
    stopped = 128 - returncode if returncode < 0 else returncode
    if saved is not None and not stop.killed and stopped in (saved, 128 + stop.signum):
        # The workers caught the forwarded SIGTERM as a preemption signal, committed a
        # checkpoint and chose their exit code: the one a requeue script tests for. (The child
        # exits with it, or, torchrun, with 128 + signal; any other code is a failure that a
        # record cannot hide.)
        _say(
            f"stopped by {signal_name(stop.signum)}; the job saved its checkpoint; "
            f"exit code {saved}"
        )
        return saved
    code = 128 + stop.signum
    _say(f"stopped by {signal_name(stop.signum)}; exit code {code}")
    return code
