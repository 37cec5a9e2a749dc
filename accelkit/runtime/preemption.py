"""Preemption: signal handlers that only set a flag, and the agreement every process reaches at
the same step boundary.

A scheduler that preempts a job (SLURM's ``--signal``, Kubernetes' and spot VMs' SIGTERM) sends
a signal and waits a grace period before SIGKILL. Two pieces here turn that into a decision that
every process shares; the save policies that use it live in :mod:`accelkit.runtime.saving`:

* :class:`SignalFlag`: the handler of each of the run's ``preemption_signals`` records the
  signal number and returns. No I/O, no lock, no collective and no save in a handler: a save
  started there could interrupt the very collective the other processes are waiting in, and
  deadlock (what Lightning's SIGTERM save does).
* :class:`Agreement`: at a step boundary every process contributes its local view (a signal
  seen, a save due on the main process, the script asking itself) to one small
  ``all_reduce(MAX)``. It is started without blocking at one boundary and read at the next, so
  the collective overlaps a whole step and the decision is the same tensor on every process by
  construction. On one process there is no collective at all.

A process that stopped for a preemption after committing its checkpoint raises
:class:`PreemptionExit` at the step boundary where it saved, and leaves :func:`write_exit_record`
for ``accelkit launch``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import stat
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = [
    "DEFAULT_EXIT_CODE",
    "ENV_PREEMPTION_FILE",
    "ENV_PREEMPTION_JOB",
    "MAX_RECORD_BYTES",
    "Agreement",
    "PreemptionExit",
    "SignalFlag",
    "check_exit_code",
    "parse_signals",
    "read_exit_record",
    "signal_name",
    "spare_child_processes",
    "write_exit_record",
]

#: The exit code of a process that stopped for a preemption after committing its checkpoint:
#: ``EX_TEMPFAIL`` of ``sysexits.h`` ("a temporary failure; the user is invited to retry").
DEFAULT_EXIT_CODE = 75

#: Set by ``accelkit launch`` for its workers: where the main process records that the job
#: stopped for a preemption (exit code, signal, step, checkpoint), so that the launcher passes
#: the exit code through and says so in one line.
ENV_PREEMPTION_FILE = "ACCELKIT_PREEMPTION_FILE"
#: Set by ``accelkit launch`` with :data:`ENV_PREEMPTION_FILE`: a random name of this job that
#: its record carries, so that the launcher takes no record of another job for its own.
ENV_PREEMPTION_JOB = "ACCELKIT_PREEMPTION_JOB"

# Signals a process cannot catch (or that only a debugger should own).
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
# The installed flags of this process (spare_child_processes blocks what they watch).
_INSTALLED: list[SignalFlag] = []
# Never blocked in child processes: they are how a parent stops them (multiprocessing's
# terminate(), a terminal's Ctrl-C to the foreground group).
_STOPPING = frozenset({signal.SIGTERM, signal.SIGINT})


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; ``"signal 99"`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _catchable() -> list[str]:
    return sorted(
        s.name for s in signal.Signals if s.name.startswith("SIG") and s.name not in _UNCATCHABLE
    )


def parse_signals(values: Iterable[str | int] | str | int | None) -> tuple[int, ...]:
    """The signal numbers ``ProjectConfiguration(preemption_signals=...)`` names.

    Args:
        values: names (``"SIGTERM"``, ``"USR1"``) or numbers; one value alone is accepted too.

    Returns:
        The numbers, without duplicates, in the given order.

    Raises:
        ConfigurationError: naming the value when it is no signal, or one that cannot be caught
            (SIGKILL, SIGSTOP), and the signals that can be used.
    """
    if values is None:
        return ()
    if isinstance(values, (str, int)):
        values = (values,)
    found: list[int] = []
    for value in values:
        number = _one_signal(value)
        if number not in found:
            found.append(number)
    return tuple(found)


def _one_signal(value: object) -> int:
    fix = "Use a catchable signal by name or number, e.g. preemption_signals=('SIGTERM', 'SIGUSR1')"
    if isinstance(value, bool) or not isinstance(value, (str, int, signal.Signals)):
        raise ConfigurationError(
            f"preemption_signals: {short(value)} is not a signal name or number. {fix}."
        )
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        member = getattr(signal.Signals, name, None)
        if member is None:
            raise ConfigurationError(
                f"preemption_signals: {short(value)} is not a signal of this system. {fix}; "
                f"known: {', '.join(_catchable())}."
            )
        number = int(member)
    else:
        number = int(value)
        try:
            name = signal.Signals(number).name
        except ValueError:
            raise ConfigurationError(
                f"preemption_signals: {number} is not a signal number of this system. {fix}."
            ) from None
    if name in _UNCATCHABLE:
        raise ConfigurationError(
            f"preemption_signals: {name} cannot be caught by any process, so nothing can be "
            f"saved when it arrives. {fix}; the scheduler sends SIGKILL only after the grace "
            "period that the caught signal starts."
        )
    return number


def check_exit_code(value: object) -> None:
    """Refuse a ``preemption_exit_code`` a process cannot exit with.

    Raises:
        ConfigurationError: naming the value and the range.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ConfigurationError(
            f"preemption_exit_code={short(value)}: expected an exit status from 0 to 255 "
            f"(default {DEFAULT_EXIT_CODE}, EX_TEMPFAIL: 'try again', what a requeue script "
            "tests for)."
        )


class PreemptionExit(SystemExit):
    """The run stopped for a preemption after committing its checkpoint (the script never
    asked: see ``docs/guides/preemption.md``).

    Raised at the step boundary where accelkit saved (a prepared dataloader asked for its next
    batch), after the trackers were finished and every process met. It is a ``SystemExit``, so
    uncaught it ends the process with ``code`` (``preemption_exit_code``) and no traceback, as
    a requeue script expects; a script may catch it to run cleanup of its own, then re-raise.

    Attributes:
        code: the exit status (``ProjectConfiguration.preemption_exit_code``).
        signum: the signal that was agreed.
        step: the optimizer step the checkpoint holds.
        checkpoint: the checkpoint's path (``None`` if none was saved or loaded).
    """

    def __init__(self, code: int, *, signum: int, step: int, checkpoint: str | None) -> None:
        super().__init__(code)
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint


class SignalFlag:
    """Records the first of ``signals`` that arrives; its handler does nothing else.

    Args:
        signals: the signal numbers to catch.

    Raises:
        ConfigurationError: when installed outside the main thread (Python delivers signals
            to the main thread only, and only it may install handlers).
    """

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = signals
        self.signum = 0  # the first signal that arrived (0: none)
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Only plain assignments: see the module's docstring.
        if not self.signum:
            self.signum = signum
        self.count += 1

    @property
    def raised(self) -> bool:
        """Whether one of the signals arrived at this process."""
        return self.signum != 0

    def install(self) -> None:
        """Install the handlers (remembering the previous ones)."""
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigurationError(
                "preemption_signals: the Accelerator must be created in the main thread to "
                "catch signals (Python runs signal handlers there only); create it there, or "
                "leave preemption_signals empty."
            )
        self._previous = {sig: signal.signal(sig, self._record) for sig in self.signals}
        _INSTALLED.append(self)

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        previous, self._previous = self._previous, {}
        if self in _INSTALLED:
            _INSTALLED.remove(self)
        if previous and threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def spare_child_processes() -> Iterator[None]:
    """Start child processes inside this block (DataLoader workers) so that the preemption
    signals this process watches, SIGTERM and SIGINT excepted, cannot kill them.

    A signal sent to every process of a job (SLURM's ``--signal=USR1@120`` without ``B:``
    signals the whole job step) would end a worker started with ``spawn`` or ``forkserver``
    (a fresh interpreter: SIGUSR1's default action is to terminate), and the training process
    would fail on its next batch instead of saving. The block holds those signals blocked in
    this thread: a child inherits the blocked mask across ``fork`` and ``exec``, so the signal
    stays pending there for good, while this process gets any that arrived in the block as
    soon as it ends. SIGTERM and SIGINT stay deliverable to children: they are how a parent
    stops its workers (``terminate()``) and how a terminal's Ctrl-C reaches them.
    """
    blocked = {sig for flag in _INSTALLED for sig in flag.signals} - _STOPPING
    if not blocked:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Agreement:
    """One shared decision per step boundary, by an ``all_reduce(MAX)`` started at one boundary
    and read at the next (none on one process).

    Args:
        world_size: the number of processes (1: no collective).
        group: the process group (``None``: the default one).
    """

    def __init__(self, world_size: int, group: Any = None) -> None:
        self.world_size = world_size
        self.group = group
        self._work: Any = None
        self._tensor: Any = None
        self._values: Any = None  # array.array("q") sharing the tensor's memory
        self.rounds = 0

    def poll(self, local: list[int]) -> list[int]:
        """Contribute ``local`` and return the agreed values of the previous round.

        On several processes the values returned are the MAX over every process of what each
        passed at its previous call (zeros at the first), so they are the same list on every
        process; on one process they are ``local`` itself.

        The reduced tensor is made once and reused (it shares its memory with a small array
        that is written and read directly): a round allocates nothing.
        """
        self.rounds += 1
        if self.world_size <= 1:
            return list(local)
        import torch.distributed as dist

        values = self._values
        if self._work is not None:
            self._work.wait()
            agreed = values.tolist()
        else:
            agreed = [0] * len(local)
        if values is None or len(values) != len(local):
            import torch

            # Only when no round is in flight: the first round (a length never changes).
            values = self._values = array.array("q", local)
            self._tensor = torch.frombuffer(values, dtype=torch.int64)
        else:
            values[:] = array.array("q", local)
        self._work = dist.all_reduce(
            self._tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return agreed

    def close(self) -> None:
        """Wait for the round in flight, then tear down the agreement's own group while the
        other processes are still there (a gloo group left to the interpreter's teardown can
        abort the process with "terminate called without an active exception")."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        group, self.group = self.group, None
        if group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(group)


#: The largest exit record the launcher reads (a real one is a few hundred bytes).
MAX_RECORD_BYTES = 1 << 16


def write_exit_record(path: str, record: dict[str, Any]) -> None:
    """Write ``record`` (JSON) to ``path`` for the launcher (replaced atomically), tagged with
    this job's ``ACCELKIT_PREEMPTION_JOB`` when the launcher set one.

    The temporary file is created afresh (never through a link that was already there), readable
    by this user only.

    Raises:
        OSError: when it cannot be written (the caller logs it: the exit code still says it).
    """
    job = os.environ.get(ENV_PREEMPTION_JOB)
    if job:
        record = {**record, "job": job}
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        os.unlink(tmp)  # a leftover of this pid's earlier try (or a planted link)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_exit_record(path: str, job: str | None = None) -> dict[str, Any] | None:
    """The record :func:`write_exit_record` left at ``path``; ``None`` if there is none or it is
    not one (the launcher then reports the job as it would without it).

    The file is untrusted input: it is opened without following a link and without blocking
    (a FIFO never holds the launcher), read only if it is a regular file of this user of at most
    :data:`MAX_RECORD_BYTES`, and taken only if it is a JSON object with an integer
    ``exit_code`` from 0 to 255 and, when ``job`` is given, ``"job": job`` (a record of another
    job, or one written without a job, is not this job's).

    Args:
        path: the file (``ACCELKIT_PREEMPTION_FILE``).
        job: the job's ``ACCELKIT_PREEMPTION_JOB``, which a record must carry (``None``: any).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:
        return None  # none, a link (ELOOP), or unreadable
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_RECORD_BYTES:
            return None
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            return None
        raw = os.read(fd, MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_RECORD_BYTES:
        return None  # grew while being read
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    code = data.get("exit_code")
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        return None
    if job is not None and data.get("job") != job:
        return None
    return dict(data)
