"""Save decisions: policies that say when to save, and the decider that turns them into one
answer every process reaches at the same call.

A save policy is any object with the small :class:`SavePolicy` protocol: a ``reason`` (what the
manifest records), ``shared`` (whose view decides) and ``due(progress)``. accelkit ships
:class:`EveryNSteps`, :class:`EverySeconds`, :class:`OnPreemption` and :class:`AnyOf`;
``ProjectConfiguration(save_every_steps=, save_every_seconds=)`` builds them
(:func:`policy_from_settings`), and ``Accelerator(save_policy=...)`` takes one of the user's
own. Accelerate has no counterpart: its scripts decide in their own loop.

Why ``shared``: every process must take the same decision at the same call, or one process
saves (a collective) while another trains on (another collective) and both hang. A policy that
reads only what every process counts alike (optimizer steps, the agreed preemption) is
evaluated on each process (``shared = False``). A policy that reads anything one machine sees
(a clock, a file, a queue) is evaluated on the main process only, and its answer is shared
through the :class:`~accelkit.runtime.preemption.Agreement` (``shared = True``): it is seen by
every process at the next round, tagged with the number of saves made so far, so that a
decision a save already answered is never taken twice. The other processes' clocks are never
read.

Every process must pass the same boundaries in the same order (each calls the prepared
optimizer's ``step()``, iterates the prepared dataloaders, calls ``should_save()``): this is what
a data-parallel script does anyway, and what its gradient all-reduces already require.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol, runtime_checkable

from accelkit._text import short
from accelkit.errors import AccelkitError, ConfigurationError
from accelkit.runtime.preemption import Agreement, SignalFlag

__all__ = [
    "MAX_ROUND_SECONDS",
    "MAX_ROUND_STEPS",
    "REASONS",
    "ROUND_BUDGET",
    "ROUND_SECONDS",
    "STEPLESS_ROUND",
    "AnyOf",
    "EveryNSteps",
    "EverySeconds",
    "OnPreemption",
    "Progress",
    "RoundRider",
    "SaveDecider",
    "SavePolicy",
    "SavePolicyError",
    "check_interval",
    "policy_from_settings",
]

logger = logging.getLogger(__name__)

#: Why a checkpoint was made (the manifest's ``reason``), lowest priority first: a save that
#: several policies ask for records the highest.
REASONS = ("user", "interval", "preemption")
_RANK = {reason: rank for rank, reason in enumerate(REASONS)}
_tuple_new = tuple.__new__


class Progress(NamedTuple):
    """What a :class:`SavePolicy` decides from.

    Attributes:
        steps: optimizer steps taken (counted alike on every process).
        last_save_step: the optimizer step of the newest checkpoint saved or loaded in this run
            (``None``: none yet).
        seconds_since_save: seconds since that checkpoint (or the run's start) on the main
            process's clock; ``None`` for a policy with ``shared = False``, which must not read
            a clock.
        preempted: the agreed preemption: some process received a preemption signal.
        saved_since_preemption: a save was made since the preemption was agreed.
    """

    steps: int
    last_save_step: int | None
    seconds_since_save: float | None
    preempted: bool
    saved_since_preemption: bool


@runtime_checkable
class SavePolicy(Protocol):
    """When to save: the protocol of ``Accelerator(save_policy=...)``.

    Attributes:
        reason: what a checkpoint saved because of this policy records in its manifest: one of
            :data:`REASONS` (a user's policy normally says ``"interval"``).
        shared: ``False`` when :meth:`due` reads only what every process counts alike (it is
            then asked on every process); ``True`` when it reads anything one machine sees (a
            clock, a file): it is then asked on the main process only and its answer is shared
            with the others at the next round of the agreement (see the module's docstring).

    Example:
        >>> class AtSteps:
        ...     reason, shared = "interval", False
        ...     def __init__(self, *steps): self.steps = set(steps)
        ...     def due(self, progress):  # not twice at the step of the last save
        ...         steps = progress.steps
        ...         return steps in self.steps and steps != progress.last_save_step
        >>> accelerator = Accelerator(save_policy=AnyOf(AtSteps(100, 500), EverySeconds(1800)))
    """

    @property
    def reason(self) -> str:
        """One of :data:`REASONS` (see the class's docstring)."""
        ...

    @property
    def shared(self) -> bool:
        """Whose view decides (see the class's docstring)."""
        ...

    def due(self, progress: Progress) -> bool:
        """Whether a save is due now (a pure function of ``progress``; it may be asked at
        every step boundary, so keep it cheap)."""
        ...


def check_interval(
    name: str, value: object, *, integer: bool, off: str = "to save only when asked"
) -> None:
    """Refuse a ``save_every_steps``/``save_every_seconds`` (or another interval: ``off``
    says what its ``None`` means) that is not a positive number.

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
            f"{name}={short(value)}: expected {what} > 0, or None {off} "
            f"(e.g. {name}={1000 if integer else 1800})."
        )
    if not integer and value == float("inf"):
        raise ConfigurationError(f"{name}=inf: use None to turn the interval off.")


class EveryNSteps:
    """Due when ``steps`` optimizer steps were taken since the last save (or load).

    Args:
        steps: a whole number > 0.

    Raises:
        ConfigurationError: naming the value when it is not a whole number > 0.
    """

    reason = "interval"
    shared = False

    def __init__(self, steps: int) -> None:
        check_interval("EveryNSteps(steps)", steps, integer=True)
        self.steps = steps

    def due(self, progress: Progress) -> bool:
        """See :meth:`SavePolicy.due`."""
        last = progress.last_save_step
        return progress.steps - (last or 0) >= self.steps and progress.steps != last

    def __repr__(self) -> str:
        return f"EveryNSteps({self.steps})"


class EverySeconds:
    """Due when ``seconds`` passed since the last save (or load, or the run's start) on the
    main process's clock, shared with the others through the agreement.

    Args:
        seconds: a number > 0.

    Raises:
        ConfigurationError: naming the value when it is not a finite number > 0.
    """

    reason = "interval"
    shared = True

    def __init__(self, seconds: float) -> None:
        check_interval("EverySeconds(seconds)", seconds, integer=False)
        self.seconds = seconds

    def due(self, progress: Progress) -> bool:
        """See :meth:`SavePolicy.due`."""
        since = progress.seconds_since_save
        return since is not None and since >= self.seconds

    def __repr__(self) -> str:
        return f"EverySeconds({self.seconds:g})"


class OnPreemption:
    """Due once a preemption signal was agreed, until a save answers it."""

    reason = "preemption"
    shared = False

    def due(self, progress: Progress) -> bool:
        """See :meth:`SavePolicy.due`."""
        return progress.preempted and not progress.saved_since_preemption

    def __repr__(self) -> str:
        return "OnPreemption()"


class AnyOf:
    """Due when any of ``policies`` is; the checkpoint records the highest of their reasons.

    Args:
        *policies: :class:`SavePolicy` objects (an ``AnyOf`` among them is flattened).

    Raises:
        ConfigurationError: naming a value that is not a save policy, and what one needs.
    """

    def __init__(self, *policies: SavePolicy) -> None:
        members: list[SavePolicy] = []
        for policy in policies:
            check_policy(policy)
            members.extend(policy.policies if isinstance(policy, AnyOf) else (policy,))
        self.policies: tuple[SavePolicy, ...] = tuple(members)

    @property
    def reason(self) -> str:
        """The highest reason among the members (``"user"`` for none)."""
        return max((p.reason for p in self.policies), key=_RANK.__getitem__, default="user")

    @property
    def shared(self) -> bool:
        """Whether some member is shared (the decider splits the members itself)."""
        return any(p.shared for p in self.policies)

    def due(self, progress: Progress) -> bool:
        """See :meth:`SavePolicy.due`: any member due (asked with the same ``progress``)."""
        return any(p.due(progress) for p in self.policies)

    def __iter__(self) -> Iterator[SavePolicy]:
        return iter(self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


def check_policy(policy: object) -> None:
    """Refuse what is not a :class:`SavePolicy`.

    Raises:
        ConfigurationError: naming the value and what a save policy needs.
    """
    fix = (
        "A save policy has reason (one of " + ", ".join(map(repr, REASONS)) + "), shared "
        "(bool) and due(progress) -> bool, e.g. EveryNSteps(1000) or AnyOf(EveryNSteps(1000), "
        "EverySeconds(1800))"
    )
    if not isinstance(policy, SavePolicy):
        raise ConfigurationError(f"save_policy: {short(policy)} is not a save policy. {fix}.")
    if isinstance(policy, AnyOf):
        return
    if getattr(policy, "reason", None) not in _RANK:
        raise ConfigurationError(
            f"save_policy: {short(policy)} has reason={short(policy.reason)}. {fix}."
        )
    if not isinstance(getattr(policy, "shared", None), bool):
        raise ConfigurationError(
            f"save_policy: {short(policy)} has shared={short(policy.shared)}. {fix}."
        )


def policy_from_settings(
    every_steps: int | None, every_seconds: float | None, *, preemption: bool
) -> AnyOf | None:
    """The policy that ``ProjectConfiguration``'s settings make: ``save_every_steps``,
    ``save_every_seconds`` and, with ``preemption_signals``, :class:`OnPreemption`; ``None``
    when there is none (``should_save()`` is then always False)."""
    members: list[SavePolicy] = []
    if every_steps is not None:
        members.append(EveryNSteps(every_steps))
    if every_seconds is not None:
        members.append(EverySeconds(every_seconds))
    if preemption:
        members.append(OnPreemption())
    return AnyOf(*members) if members else None


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
_PREEMPT, _DUE, _ASKED, _SIGNAL, _EVERY, _DUE_REASON, _FAILED = range(7)


class SavePolicyError(AccelkitError, RuntimeError):
    """A save policy's ``due()`` raised. With ``shared = True`` it is asked on the main process
    only, so the others learn it through the agreement and raise this too, at the same step
    boundary (none is left waiting in the next collective); the main process's error carries
    the policy's exception as its cause."""


class RoundRider(Protocol):
    """Values that ride on the save decisions' agreement (``all_reduce(MAX)``, one round every
    ``round_every`` optimizer steps on several processes; none on one process)."""

    def contribute(self, steps: int) -> list[int]:
        """This process's values for the round that starts now (``steps``: optimizer steps
        taken); the same length at every round."""
        ...

    def agreed(self, values: list[int]) -> None:
        """The MAX over every process of what each contributed at the previous round (zeros
        at the first)."""
        ...


class SaveDecider:
    """When to save: a :class:`SavePolicy`, agreed by every process.

    It is a save observer of the accelerator's save path (:meth:`reason`, :meth:`saved`,
    :meth:`loaded`), and the accelerator's preemption part calls :meth:`advance` at each step
    boundary it is told of.

    Args:
        agreement: how processes agree (an :class:`~accelkit.runtime.preemption.Agreement`).
        flag: this process's signal flag.
        policy: when to save (``None``: never; ``should_save`` is then always False).
        is_main: whether this is the main process (whose view decides shared policies).
        clock: seconds, monotonic; injectable for tests (only the main process's is read).
        rider: values that ride on each round of the agreement (a :class:`RoundRider`: the
            straggler report's step times), so that they cost no collective of their own.
    """

    def __init__(
        self,
        agreement: Agreement,
        flag: SignalFlag,
        policy: SavePolicy | None,
        *,
        is_main: bool,
        clock: Callable[[], float] = time.monotonic,
        rider: RoundRider | None = None,
    ) -> None:
        if policy is not None:
            check_policy(policy)
        self.agreement = agreement
        self.flag = flag
        self.policy = policy
        members = tuple(policy) if isinstance(policy, AnyOf) else (policy,) if policy else ()
        # (rank of its reason, its due) of each local policy, the highest reason first: the
        # first one due is the answer (the per-step path).
        self._local = tuple(
            sorted(
                ((_RANK[p.reason], p.due) for p in members if not p.shared),
                key=lambda ranked: -ranked[0],
            )
        )
        self._shared = tuple(p for p in members if p.shared)
        self.is_main = is_main
        self.clock = clock
        self.rider = rider
        self.asked = False  # this process's script asked (should_save/preemption_requested)
        self.saves = 0  # saves made (the same count on every process: saves are collective)
        self.last_save_step: int | None = None
        self._last_save_time = clock()
        self._preempted = False
        self._signum = 0
        self._self_managed = False
        self._shared_due = 0  # the rank + 1 in REASONS of the shared policies' reason (0: none)
        self._saved_since_preemption = False
        self._boundaries = 0
        self._steps_seen = 0  # optimizer steps at the last boundary
        self._step_at = 0  # the boundary at which they last changed
        self._polled_at = 0
        self._polled_steps: int | None = None
        self._polled_time = 0.0
        self._round_cost = 0.0  # seconds a round takes on the main process (smoothed)
        self.round_every = 1  # optimizer steps between rounds (agreed; see boundary())
        self._policy_error: Exception | None = None  # a shared policy's due() raised (main)
        self._policy_told = False  # ... and every process raised it

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure shared policies' seconds with ``clock`` from now on (tests give each process
        a clock of its own to show that only the main process's is read)."""
        self.clock = clock
        self._last_save_time = clock()

    def ask(self) -> None:
        """This process's script asks for decisions itself (``should_save()``,
        ``preemption_requested``): shared with the others at the next round."""
        self.asked = True

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

    def boundary(self, steps: int, *, training: bool = True) -> bool:
        """A step boundary; ``steps``: optimizer steps taken; ``training``: a boundary of the
        training loop (not of an evaluation pass, which only starts step-less rounds). Returns
        :meth:`should_save` after it.

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
        return self.should_save(steps)

    def _shared_reason(self, steps: int) -> int:
        """The rank + 1 of the highest reason among the shared policies due now (0: none);
        asked on the main process only (or on the only process)."""
        progress = Progress(
            steps,
            self.last_save_step,
            self.clock() - self._last_save_time,
            self._preempted,
            self._saved_since_preemption,
        )
        due = [_RANK[p.reason] + 1 for p in self._shared if p.due(progress)]
        return max(due, default=0)

    def advance(self, steps: int, *, training: bool = True) -> None:
        """:meth:`boundary` without its answer: the per-step path (read the agreed state with
        :attr:`preempted`, :attr:`self_managed`, :meth:`should_save`)."""
        self._boundaries += 1
        flag = self.flag
        if self.agreement.world_size <= 1:
            # One process: its own view is the decision; no collective, no list, and the clock
            # is read only for shared policies.
            self.agreement.rounds += 1
            if flag.signum and not self._preempted:
                self._preempted = True
                self._signum = flag.signum
            if self.asked:
                self._self_managed = True
            if self._shared and not self._shared_due:
                try:
                    self._shared_due = self._shared_reason(steps)
                except Exception as exc:  # as on several processes: named, with its cause
                    self._policy_error = exc
                    self._policy_failed()
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
        due_tag = due_reason = 0
        if self._shared and self.is_main and self._policy_error is None:
            try:
                due_reason = self._shared_reason(steps)
            except Exception as exc:  # told to every process at this round, raised by all
                self._policy_error = exc
            if due_reason:
                due_tag = self.saves + 1  # "due, unless a save has been made since"
        failed = int(self._policy_error is not None)
        local = [int(flag.raised), due_tag, int(self.asked), flag.signum, every, due_reason]
        local.append(failed)
        rider = self.rider
        if rider is not None:
            local.extend(rider.contribute(steps))
        if self.is_main:
            started = time.perf_counter()
            agreed = self.agreement.poll(local)
            cost = time.perf_counter() - started
            # A smoothed cost (one slow round, a peer late at the wait, moves it a little).
            self._round_cost = cost if not self._round_cost else 0.8 * self._round_cost + 0.2 * cost
        else:
            agreed = self.agreement.poll(local)
        if rider is not None:
            rider.agreed(agreed[_FAILED + 1 :])
        if agreed[_FAILED]:
            self._policy_failed()
        if agreed[_EVERY]:
            self.round_every = agreed[_EVERY]
        if agreed[_PREEMPT] and not self._preempted:
            self._preempted = True
            self._signum = agreed[_SIGNAL]
        if agreed[_ASKED]:
            self._self_managed = True
        if agreed[_DUE] == self.saves + 1:
            self._shared_due = agreed[_DUE_REASON]

    def _policy_failed(self) -> None:
        """The agreed round says the main process's shared policy raised: raise on every
        process, at the same boundary."""
        self._policy_told = True
        error = self._policy_error
        if error is not None:
            raise SavePolicyError(
                f"save_policy {short(self.policy)}: its due() raised {type(error).__name__}: "
                f"{short(error)}. Every process stops at this step boundary. Fix the policy "
                "(a shared policy is asked on the main process only)."
            ) from error
        raise SavePolicyError(
            f"save_policy {short(self.policy)}: its due() raised on the main process (see its "
            "traceback there). Every process stops at this step boundary."
        )

    def close(self) -> None:
        """The end of the run: finish the agreement (its round in flight, its group). A shared
        policy's failure that no round told yet (the loop ended first) is logged here."""
        self.agreement.close()
        error = self._policy_error
        if error is not None and not self._policy_told:
            logger.error(
                "save_policy %s: its due() raised %s: %s after the last step boundary that "
                "could tell every process; the run ended without the saves it would have asked "
                "for. Fix the policy.",
                short(self.policy),
                type(error).__name__,
                short(error),
            )

    def due_reason(self, steps: int) -> str | None:
        """The reason of the policies due at ``steps`` (as agreed at the last boundary), the
        highest if several are; ``None`` when none is."""
        best = self._shared_due - 1
        if self._local:
            # Progress(...) without NamedTuple's own __new__: half the cost, on the per-step path.
            progress = _tuple_new(
                Progress,
                (steps, self.last_save_step, None, self._preempted, self._saved_since_preemption),
            )
            for rank, due in self._local:
                if rank <= best:
                    break
                if due(progress):
                    best = rank
                    break
        return REASONS[best] if best >= 0 else None

    def should_save(self, steps: int) -> bool:
        """Whether the policy asks for a save now."""
        return self.due_reason(steps) is not None

    # ------------------------------------------------------------------ a save observer

    def reason(self, steps: int) -> str:
        """The manifest's ``reason`` for a save made now (one of :data:`REASONS`):
        ``"preemption"`` while an agreed preemption is not answered by a save (whatever the
        policy), else the due policies' reason, else ``"user"``."""
        if self._preempted and not self._saved_since_preemption:
            return "preemption"
        return self.due_reason(steps) or "user"

    def saved(self, reason: str, path: str, steps: int) -> None:
        """A checkpoint of ``steps`` optimizer steps was saved at ``path``: restart the
        policies' intervals."""
        self.saves += 1
        self.last_save_step = steps
        self._last_save_time = self.clock()
        self._shared_due = 0
        if self._preempted:
            self._saved_since_preemption = True

    def loaded(self, path: str, steps: int, saved: int | None) -> None:
        """A state of ``steps`` optimizer steps was loaded from ``path``; ``saved``: the step
        of the newest checkpoint it comes after (``steps`` for a checkpoint; for a memory
        snapshot, the save before it): the intervals go on from there."""
        self.last_save_step = saved
        self._last_save_time = self.clock()
        self._shared_due = 0
