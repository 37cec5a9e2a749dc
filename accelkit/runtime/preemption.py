"""Preemption and save decisions: signal handlers that only set a flag, and one decision that
every process reaches at the same call.

A scheduler that preempts a job (SLURM's ``--signal``, Kubernetes' and spot VMs' SIGTERM) sends
a signal and waits a grace period before SIGKILL. Three pieces turn that into a checkpoint:

* :class:`SignalFlag`: the handler of each of the run's ``preemption_signals`` records the
  signal number and returns. No I/O, no lock, no collective and no save in a handler: a save
  started there could interrupt the very collective the other processes are waiting in, and
  deadlock (what Lightning's SIGTERM save does).
* :class:`Agreement`: at each step boundary every process contributes its local view (a signal
  seen, an interval due on the main process, the script asking itself) to one small
  ``all_reduce(MAX)``. It is started without blocking at one boundary and read at the next, so
  the collective overlaps a whole step and the decision is the same tensor on every process by
  construction. On one process there is no collective at all.
* :class:`SaveDecider`: the policy. ``save_every_steps`` counts optimizer steps, which every
  process counts alike; ``save_every_seconds`` is measured on the main process's clock only and
  shared through the agreement, tagged with the number of saves made so far so that a decision
  that a save already answered is never taken twice. The other processes' clocks are never read.

Every process must pass the same boundaries in the same order (each calls the prepared
optimizer's ``step()``, iterates the prepared dataloaders, calls ``should_save()``): this is what
a data-parallel script does anyway, and what its gradient all-reduces already require.
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = [
    "DEFAULT_EXIT_CODE",
    "ENV_PREEMPTION_FILE",
    "ENV_PREEMPTION_JOB",
    "MAX_RECORD_BYTES",
    "MAX_ROUND_SECONDS",
    "MAX_ROUND_STEPS",
    "REASONS",
    "ROUND_BUDGET",
    "ROUND_SECONDS",
    "STEPLESS_ROUND",
    "Agreement",
    "Decision",
    "SaveDecider",
    "SignalFlag",
    "check_exit_code",
    "check_interval",
    "parse_signals",
    "read_exit_record",
    "signal_name",
    "spare_child_processes",
    "write_exit_record",
]

#: The exit code of a process that stopped for a preemption after committing its checkpoint:
#: ``EX_TEMPFAIL`` of ``sysexits.h`` ("a temporary failure; the user is invited to retry").
DEFAULT_EXIT_CODE = 75
#: Why a checkpoint was made (the manifest's ``reason``).
REASONS = ("user", "interval", "preemption")

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


def check_interval(name: str, value: object, *, integer: bool) -> None:
    """Refuse a ``save_every_steps``/``save_every_seconds`` that is not a positive number.

    Raises:
        ConfigurationError: naming the setting, the value and the fix.
    """
    if value is None:
        return
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    what = "a whole number of optimizer steps" if integer else "a number of seconds"
    number = value if isinstance(value, kinds) and not isinstance(value, bool) else None
    if not isinstance(number, (int, float)) or not number > 0:
        raise ConfigurationError(
            f"{name}={short(value)}: expected {what} > 0, or None to save only when asked "
            f"(e.g. {name}={1000 if integer else 1800})."
        )
    if not integer and value == float("inf"):
        raise ConfigurationError(f"{name}=inf: use None to turn the interval off.")


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


#: On several processes, boundaries without an optimizer step between them start a round of the
#: agreement only every this many (see :meth:`SaveDecider.boundary`).
STEPLESS_ROUND = 8
#: On several processes, the least training time between two rounds of the agreement: steps
#: shorter than this are grouped (see :meth:`SaveDecider.boundary`), at most
#: :data:`MAX_ROUND_STEPS` to a round.
ROUND_SECONDS = 0.05
MAX_ROUND_STEPS = 100
#: On several processes, the share of training time that rounds of the agreement may take when
#: steps are shorter than :data:`ROUND_SECONDS`: where a round costs more than
#: ``ROUND_BUDGET * ROUND_SECONDS`` (a loaded machine), rounds are spaced further apart, up to
#: :data:`MAX_ROUND_SECONDS`.
ROUND_BUDGET = 0.002
#: The most training time between two rounds, whatever a round costs: a signal is agreed within
#: about twice this, and a step.
MAX_ROUND_SECONDS = 1.0

# The agreed tensor's slots (all reduced with MAX).
_PREEMPT, _DUE, _ASKED, _SIGNAL, _EVERY = range(5)


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


@dataclass(frozen=True)
class Decision:
    """What the processes agreed at one boundary.

    Attributes:
        preempted: some process received a preemption signal (sticky).
        signum: the signal (the highest number among those received), 0 if none.
        interval_due: ``save_every_steps`` or ``save_every_seconds`` is due.
        self_managed: the script asks (``should_save()``, ``preemption_requested``) on some
            process, so it saves by itself.
    """

    preempted: bool
    signum: int
    interval_due: bool
    self_managed: bool


class SaveDecider:
    """When to save: an interval, or a preemption, agreed by every process.

    Args:
        agreement: how processes agree (an :class:`Agreement`).
        flag: this process's signal flag.
        is_main: whether this is the main process (whose clock decides ``every_seconds``).
        every_steps: save every this many optimizer steps (``None``: off).
        every_seconds: save when this many seconds passed since the last save, on the main
            process's clock (``None``: off).
        clock: seconds, monotonic; injectable for tests (only the main process's is read).
    """

    def __init__(
        self,
        agreement: Agreement,
        flag: SignalFlag,
        *,
        is_main: bool,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agreement = agreement
        self.flag = flag
        self.is_main = is_main
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.clock = clock
        self.asked = False  # this process's script asked (should_save/preemption_requested)
        self.saves = 0  # saves made (the same count on every process: saves are collective)
        self.last_save_step: int | None = None
        self._last_save_time = clock()
        self._preempted = False
        self._signum = 0
        self._self_managed = False
        self._seconds_due = False
        self._saved_since_preemption = False
        self._boundaries = 0
        self._steps_seen = 0  # optimizer steps at the last boundary
        self._step_at = 0  # the boundary at which they last changed
        self._polled_at = 0
        self._polled_steps: int | None = None
        self._polled_time = 0.0
        self._round_cost = 0.0  # seconds a round takes on the main process (smoothed)
        self.round_every = 1  # optimizer steps between rounds (agreed; see boundary())

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure ``every_seconds`` with ``clock`` from now on (tests give each process a
        clock of its own to show that only the main process's is read)."""
        self.clock = clock
        self._last_save_time = clock()

    @property
    def preempted(self) -> bool:
        """Agreed: some process received a preemption signal (as of the last boundary)."""
        return self._preempted

    @property
    def signum(self) -> int:
        """Agreed: the signal received (0 if none)."""
        return self._signum

    @property
    def self_managed(self) -> bool:
        """Agreed: the script asks for decisions itself, so it is not saved behind its back."""
        return self._self_managed

    @property
    def saved_since_preemption(self) -> bool:
        """Whether a save was made since the preemption was agreed."""
        return self._saved_since_preemption

    def boundary(self, steps: int, *, training: bool = True) -> Decision:
        """A step boundary; ``steps``: optimizer steps taken; ``training``: a boundary of the
        training loop (not of an evaluation pass, which only starts step-less rounds).

        On one process every boundary decides at once. On several, a round of the agreement
        starts at a boundary only when ``round_every`` optimizer steps were taken since the
        last round (or :data:`STEPLESS_ROUND` boundaries passed since both the last round and
        the last optimizer step: evaluation batches, ``should_save()`` in a loop without a
        prepared optimizer), and is read at the next round's boundary. ``round_every`` is 1
        for steps of :data:`ROUND_SECONDS` or more; for faster steps the main process measures
        them and shares, in the agreement itself, how many make :data:`ROUND_SECONDS`, so that
        agreeing costs one small collective per ~50 ms of training whatever the step time
        (further apart, up to :data:`MAX_ROUND_SECONDS`, where the main process measures that a
        round costs more than :data:`ROUND_BUDGET` of that time). Every input of the rule is
        counted alike or agreed, so every process starts the same rounds.
        """
        self.advance(steps, training=training)
        return self.decision(steps)

    def advance(self, steps: int, *, training: bool = True) -> None:
        """:meth:`boundary` without building its :class:`Decision`: the per-step path (read
        the agreed state with :attr:`preempted`, :attr:`self_managed`, :meth:`should_save`).
        """
        self._boundaries += 1
        flag = self.flag
        seconds = self.every_seconds
        if self.agreement.world_size <= 1:
            # One process: its own view is the decision; no collective, no list, and the clock
            # is read only for save_every_seconds.
            self.agreement.rounds += 1
            if flag.signum and not self._preempted:
                self._preempted = True
                self._signum = flag.signum
            if self.asked:
                self._self_managed = True
            if (
                seconds is not None
                and not self._seconds_due
                and self.clock() - self._last_save_time >= seconds
            ):
                self._seconds_due = True
            return
        if steps != self._steps_seen:
            self._steps_seen, self._step_at = steps, self._boundaries
        last = self._polled_steps
        stepped = last is None or steps < last or steps - last >= self.round_every
        if (
            not (stepped and training)
            and self._boundaries - max(self._polled_at, self._step_at) < STEPLESS_ROUND
        ):
            return
        every = 0
        if self.is_main:
            now = time.monotonic()
            if last is not None and steps > last:
                per_step = (now - self._polled_time) / (steps - last)
                # Rounds ROUND_SECONDS apart, or further where a round costs more than
                # ROUND_BUDGET of that (measured here, on the main process: shared below).
                spacing = min(
                    MAX_ROUND_SECONDS, max(ROUND_SECONDS, self._round_cost / ROUND_BUDGET)
                )
                wanted = spacing / per_step if per_step > 0 else MAX_ROUND_STEPS
                every = max(1, min(MAX_ROUND_STEPS, math.ceil(wanted)))
                if per_step >= ROUND_SECONDS:
                    every = 1  # a step is long enough to agree at each
            self._polled_time = now
        self._polled_steps, self._polled_at = steps, self._boundaries
        due_tag = 0
        if seconds is not None and self.is_main and self.clock() - self._last_save_time >= seconds:
            due_tag = self.saves + 1  # "due, unless a save has been made since"
        local = [int(flag.raised), due_tag, int(self.asked), flag.signum, every]
        if self.is_main:
            started = time.perf_counter()
            agreed = self.agreement.poll(local)
            cost = time.perf_counter() - started
            # A smoothed cost (one slow round, a peer late at the wait, moves it a little).
            self._round_cost = cost if not self._round_cost else 0.8 * self._round_cost + 0.2 * cost
        else:
            agreed = self.agreement.poll(local)
        if agreed[_EVERY]:
            self.round_every = agreed[_EVERY]
        if agreed[_PREEMPT] and not self._preempted:
            self._preempted = True
            self._signum = agreed[_SIGNAL]
        if agreed[_ASKED]:
            self._self_managed = True
        if agreed[_DUE] == self.saves + 1:
            self._seconds_due = True

    def interval_due(self, steps: int) -> bool:
        """Whether an interval is due at ``steps`` (as agreed at the last boundary)."""
        every = self.every_steps
        since = steps - (self.last_save_step or 0)
        by_steps = every is not None and since >= every and steps != self.last_save_step
        return by_steps or self._seconds_due

    def decision(self, steps: int) -> Decision:
        """The agreed state as of the last boundary (no communication)."""
        return Decision(self._preempted, self._signum, self.interval_due(steps), self._self_managed)

    def should_save(self, steps: int) -> bool:
        """Whether a save is due now: an interval, or a preemption not saved yet."""
        if self._preempted and not self._saved_since_preemption:
            return True
        return self.interval_due(steps)

    def reason(self, steps: int) -> str:
        """The manifest's ``reason`` for a save made now (one of :data:`REASONS`)."""
        if self._preempted and not self._saved_since_preemption:
            return "preemption"
        if self.interval_due(steps):
            return "interval"
        return "user"

    def saved(self, steps: int) -> None:
        """A checkpoint of ``steps`` optimizer steps was saved (or loaded): restart the
        intervals."""
        self.saves += 1
        self.last_save_step = steps
        self._last_save_time = self.clock()
        self._seconds_due = False
        if self._preempted:
            self._saved_since_preemption = True

    def loaded(self, steps: int) -> None:
        """A checkpoint of ``steps`` optimizer steps was loaded: it is the newest state."""
        self.last_save_step = steps
        self._last_save_time = self.clock()
        self._seconds_due = False


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
