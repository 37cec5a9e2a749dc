"""The preemption part of the :class:`~accelkit.Accelerator`: ``should_save()``,
``preemption_requested``, and the save-and-exit of a script that never asks.

The flag and the agreement live in :mod:`accelkit.runtime.preemption`, the save policies and
their decider in :mod:`accelkit.runtime.saving`; this part connects them to the run through
the hooks the run offers, never by setting attributes on other parts: a hook on the step
boundaries (``GradientState.on_boundary``, reported by the prepared optimizer's ``step()`` and
the prepared dataloader's next batch), two observers of the save path
(``Checkpointing.add_observer``: the decider, so that every ``save_state`` restarts the
intervals and records its ``reason``; this part, for the preemption checkpoint's report) and the
drain deadline of the end of the run.

**Who saves on a preemption.** A script that asks -- calls :meth:`Preemption.should_save` or
reads :attr:`Preemption.preemption_requested` once, on any process -- is trusted to save
itself: from that call on (agreed by every process at the next boundary) accelkit never saves
behind its back, so one preemption makes one checkpoint. A script that never asks, with
``preemption_signals`` and ``automatic_checkpoint_naming``, is saved by accelkit when a prepared
dataloader is next asked for a batch (see :meth:`Preemption.boundary` for the exact points),
through the normal commit protocol; then the trackers are finished, the processes meet and
each raises :class:`~accelkit.runtime.preemption.PreemptionExit` (a ``SystemExit`` with
``preemption_exit_code``) at that step boundary, into the script's ``for`` over the loader. A
save in flight is committed first, and if the newest committed state already is the current
optimizer step, no second checkpoint is made.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.storage import basename
from accelkit.errors import ConfigurationError
from accelkit.runtime.preemption import (
    ENV_PREEMPTION_FILE,
    Agreement,
    PreemptionExit,
    SignalFlag,
    signal_name,
    write_exit_record,
)
from accelkit.runtime.saving import (
    AnyOf,
    OnPreemption,
    RoundRider,
    SaveDecider,
    SavePolicy,
    check_policy,
    policy_from_settings,
)
from accelkit.training.boundary import SavePoints

if TYPE_CHECKING:
    from accelkit._accelerator.checkpointing import Checkpointing
    from accelkit.checkpointing.config import ProjectConfiguration
    from accelkit.runtime.state import AcceleratorState
    from accelkit.training.optim import GradientState

__all__ = ["Preemption"]

logger = logging.getLogger("accelkit.preemption")


class Preemption:
    """Save decisions and preemption for one run (see the module's docstring).

    Args:
        config: the run's configuration (``save_every_*``, ``preemption_*``).
        state: this process's identity.
        gradient_state: the step state on whose boundaries this part registers its hook.
        checkpointing: the saving part (the decider and this part observe its saves).
        finish: the end-of-run cleanup before a preemption exit (trackers finished, saves
            committed): ``Accelerator.end_training``.
        save_policy: the user's :class:`~accelkit.runtime.saving.SavePolicy`, instead of
            ``save_every_steps``/``save_every_seconds`` (``None``: those settings).
        rider: values that ride on the agreement's rounds (the straggler report's step
            times); with one, the rounds run at the step boundaries even without
            ``preemption_signals``.

    Raises:
        ConfigurationError: ``save_policy`` is not a save policy, or is given together with
            ``save_every_steps``/``save_every_seconds``.
    """

    def __init__(
        self,
        config: ProjectConfiguration,
        state: AcceleratorState,
        gradient_state: GradientState,
        checkpointing: Checkpointing,
        finish: Callable[[], None],
        save_policy: SavePolicy | None = None,
        rider: RoundRider | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.gradient_state = gradient_state
        self.checkpointing = checkpointing
        self.finish = finish
        signals = config.preemption_signal_numbers()
        self.watching = bool(signals)
        self.flag = SignalFlag(signals)
        self.decider = SaveDecider(
            Agreement(
                state.num_processes,
                _agreement_group(state.num_processes, bool(signals) or rider is not None),
            ),
            self.flag,
            _policy(config, save_policy, preemption=self.watching),
            is_main=state.is_main_process,
            rider=rider,
        )
        self.policies = self.decider.policy is not None
        self.automatic = self.watching and config.automatic_checkpoint_naming
        self.exiting = False
        self.closed = False  # end_training() ran: no more rounds
        self.points = SavePoints(gradient_state)
        # Registered with the parts that offer hooks, in this order: the decider hears of a
        # save before this part reports it.
        checkpointing.add_observer(self.decider)
        checkpointing.add_observer(self)
        checkpointing.register_drain_deadline(self.drain_deadline)
        self.reported = False
        self._unhook: Callable[[], None] | None = None
        if self.watching:
            self.flag.install()
        if self.watching or rider is not None:
            self._unhook = gradient_state.on_boundary.register(self.boundary)

    # ------------------------------------------------------------------ the script asks

    def should_save(self) -> bool:
        """Whether to save now, the same answer on every process: ``save_every_steps``
        optimizer steps or ``save_every_seconds`` (on the main process's clock) passed since
        the last save, or a preemption signal arrived and no save was made since.

        Call it on every process at the same point of the loop (it is a step boundary where the
        processes agree, with a collective started here and read at the next boundary). The
        first call marks the script as saving by itself: accelkit then never saves on a
        preemption behind its back.

        Returns:
            True when the script should call ``save_state()`` now.

        Example:
            >>> for batch in loader:
            ...     train_step(batch)
            ...     if accelerator.should_save():
            ...         accelerator.save_state()
            ...     if accelerator.preemption_requested:
            ...         break
        """
        self.decider.ask()
        if not self.policies or self.closed:
            return False
        steps = self.gradient_state.optimizer_steps
        self.decider.advance(steps)
        return self.decider.should_save(steps)

    @property
    def preemption_requested(self) -> bool:
        """True on every process, from the same step boundary on, once any process received one
        of ``ProjectConfiguration.preemption_signals``.

        Reading it marks the script as saving by itself (see :meth:`should_save`). It is the
        value agreed at the last step boundary (the prepared optimizer's ``step()``, a prepared
        dataloader's next batch, ``should_save()``), so processes that read it between the same
        two boundaries read the same value; on one process it also looks at the signal now.
        """
        self.decider.ask()
        if self.watching and self.state.num_processes == 1 and not self.closed:
            self.decider.advance(self.gradient_state.optimizer_steps)
        return self.decider.preempted

    # ------------------------------------------------------------------ boundaries

    def boundary(self, where: str, source: object) -> None:
        """The hook on the step boundaries (``GradientState.on_boundary``): agree; at a save
        point (:class:`~accelkit.training.boundary.SavePoints`), save and exit if a preemption
        was agreed and the script does not save by itself. A script resumed from there replays
        exactly what follows.
        """
        if self.exiting or self.closed:
            return
        steps = self.gradient_state.optimizer_steps
        decider = self.decider
        point = self.points.reached(where, source)
        if where == "step":
            # On several processes the round of this step starts at the next boundary (the
            # next batch, or should_save()), to be read a whole step later.
            if self.state.num_processes == 1:
                decider.advance(steps)
            return
        # Another loader's batches (an evaluation pass) do not start the step's round: the
        # training loader's next batch does, so a signal during evaluation is agreed a step
        # after it, not two.
        decider.advance(steps, training=self.points.is_training(source))
        if point and decider.preempted and self.automatic and not decider.self_managed:
            self.save_and_exit()

    def save_and_exit(self) -> None:
        """Commit a preemption checkpoint (unless the newest one already holds this step),
        finish the run and end it with ``preemption_exit_code``.

        Raises:
            PreemptionExit: always (a ``SystemExit`` with ``preemption_exit_code``).
        """
        self.exiting = True
        steps = self.gradient_state.optimizer_steps
        saved_now = False
        try:
            self.checkpointing.wait_for_checkpoints()  # the save in flight, committed first
            fresh = self.decider.last_save_step == steps
        except CheckpointError as exc:
            logger.warning("preemption: the save in flight failed (%s); saving again", exc)
            fresh = False
        if not fresh:
            self.checkpointing.save_state(async_save=False)
            saved_now = True
        path = self.checkpointing.last_path
        if not saved_now:
            self.report(steps, path, saved=False)
        if self.config.replicate_to is not None:
            self.replicate_before_exit(path)
        self.finish()
        self.decider.agreement.close()
        self.state.wait_for_everyone()
        self.flag.restore()
        raise PreemptionExit(
            self.config.preemption_exit_code,
            signum=self.decider.signum,
            step=steps,
            checkpoint=path,
        )

    def replicate_before_exit(self, path: str | None) -> None:
        """Wait up to ``replicate_preemption_seconds`` for the queued checkpoints (the
        preemption checkpoint included) to reach the remote tier, and say whether they did
        (the main process replicates; the others return at once)."""
        deadline = self.config.replicate_preemption_seconds
        left = self.checkpointing.close_replication(deadline)  # logs what is left
        if self.state.is_main_process and path is not None and basename(path) not in left:
            logger.warning(
                "accelkit: preemption: %s is on the remote tier %s", path, self.config.replicate_to
            )

    def drain_deadline(self) -> float | None:
        """How long the end of the run may wait for the replication queue:
        ``replicate_preemption_seconds`` once a preemption signal arrived (agreed, or seen by
        this process), so that a script that asks (``end_training(); sys.exit(75)``) leaves
        within its grace period as one that never asks does; ``None`` otherwise
        (``replicate_deadline_seconds``)."""
        if self.watching and (self.decider.preempted or self.flag.raised):
            return self.config.replicate_preemption_seconds
        return None

    # ------------------------------------------------------------------ a save observer

    def reason(self, steps: int) -> str | None:
        """No opinion on a save's reason: the decider's answers."""
        return None

    def saved(self, reason: str, path: str, steps: int) -> None:
        """Told of each ``save_state``: a preemption checkpoint is reported."""
        if reason == "preemption":
            self.report(steps, path, saved=True)

    def loaded(self, path: str, steps: int, saved: int | None) -> None:
        """Told of each ``load_state``: nothing to do."""

    def report(self, steps: int, path: str | None, *, saved: bool) -> None:
        """The main process's log line for a preemption checkpoint (which signal, which step,
        where), and the record ``accelkit launch`` reads to pass the exit code through (written
        by the local main process of each machine, for that machine's launcher)."""
        if self.reported:
            return
        self.reported = True
        code = self.config.preemption_exit_code
        name = signal_name(self.decider.signum)
        if self.state.is_main_process:
            where = path if path is not None else "(no checkpoint was saved or loaded yet)"
            what = "saved a preemption checkpoint" if saved else "the newest checkpoint holds it"
            logger.warning(
                "accelkit: %s received: %s at optimizer step %d: %s; exit code %d",
                name,
                what,
                steps,
                where,
                code,
            )
        # Each machine's launcher reads its own record: the local main process writes it.
        record_path = os.environ.get(ENV_PREEMPTION_FILE)
        if record_path and self.state.is_local_main_process:
            record = {"exit_code": code, "signal": name, "step": steps, "checkpoint": path}
            try:
                write_exit_record(record_path, record)
            except OSError as exc:
                # The checkpoint is committed; the exit code still says so, the launcher then
                # reports it as a worker's failure.
                logger.warning("accelkit: preemption: cannot write %s (%s)", record_path, exc)

    # ------------------------------------------------------------------ end of the run

    def close(self) -> None:
        """At the end of the run (``end_training``): put back the previous signal handlers and
        finish the agreement (its round in flight, its group); no decisions are made after."""
        self.closed = True
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        self.flag.restore()
        self.decider.close()


def _policy(
    config: ProjectConfiguration, save_policy: SavePolicy | None, *, preemption: bool
) -> SavePolicy | None:
    """The run's save policy: the user's (with :class:`OnPreemption` when preemption signals are
    watched, so that ``should_save()`` answers a preemption as documented), else the one the
    configuration's settings make."""
    if save_policy is None:
        return policy_from_settings(
            config.save_every_steps, config.save_every_seconds, preemption=preemption
        )
    check_policy(save_policy)
    given = [
        f"{name}={getattr(config, name)!r}"
        for name in ("save_every_steps", "save_every_seconds")
        if getattr(config, name) is not None
    ]
    if given:
        raise ConfigurationError(
            f"Accelerator(save_policy={save_policy!r}) and "
            f"ProjectConfiguration({', '.join(given)}) both say when to save; give one: "
            "e.g. save_policy=AnyOf(EveryNSteps(1000), yours), with the save_every_* "
            "settings left None."
        )
    return AnyOf(save_policy, OnPreemption()) if preemption else save_policy


def _agreement_group(world_size: int, rounds: bool) -> object:
    """A gloo group of its own for the agreement (``None``: the default group), so that its
    small all_reduce never queues behind, or holds up, the training's gradient all-reduces;
    ``rounds``: the agreement runs at every step boundary (preemption signals are watched, or
    values ride on it). Created on every process alike (the settings are the same
    everywhere)."""
    if world_size <= 1 or not rounds:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")
