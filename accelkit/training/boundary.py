"""The step boundaries of a training loop, and the hooks registered there.

A script's loop is its own: accelkit sees it only where the script calls a prepared object.
Those calls are the step boundaries: a prepared optimizer's synchronising ``step()``, and a
prepared dataloader asked for a batch. The objects that see a boundary call
:class:`StepBoundary`; whatever wants to act there (the save decisions, the preemption
agreement) registers a hook with it, so the optimizer and the dataloader know nothing of what
runs (and no part assigns attributes on them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["BoundaryHook", "SavePoints", "StepBoundary"]

#: A hook: ``hook(where, source)`` (see :class:`StepBoundary`).
BoundaryHook = Callable[[str, object], None]


class StepBoundary:
    """The registered hooks of one run's step boundaries (``GradientState.on_boundary``).

    A boundary is reported as ``where``, ``source``:

    * ``"step"``: after a prepared optimizer's synchronising ``step()`` (``source``: the
      optimizer);
    * ``"batch"``: a prepared dataloader (``source``) is asked for a batch, before it starts a
      pass or hands out the next one: the state is the state after a whole loop body;
    * ``"end"``: it is asked for one after the last batch of a pass (the script's epoch-end code
      comes next, not another batch).

    Hooks run in the order they were registered, in the caller's thread. An exception a hook
    raises propagates to the script's call (the ``for`` over the dataloader, ``step()``): the
    preemption hook ends a run that way, with
    :class:`~accelkit.runtime.preemption.PreemptionExit`.
    """

    __slots__ = ("hooks",)

    def __init__(self) -> None:
        self.hooks: tuple[BoundaryHook, ...] = ()

    def register(self, hook: BoundaryHook) -> Callable[[], None]:
        """Run ``hook(where, source)`` at every boundary from now on.

        Returns:
            A function that removes the hook again.
        """
        self.hooks = (*self.hooks, hook)

        def remove() -> None:
            self.hooks = tuple(h for h in self.hooks if h is not hook)

        return remove

    def __call__(self, where: str, source: object) -> None:
        """Report a boundary to every hook."""
        for hook in self.hooks:
            hook(where, source)


class _StepState(Protocol):
    """What :class:`SavePoints` reads of the run's ``GradientState``."""

    @property
    def optimizer_steps(self) -> int: ...

    @property
    def active_dataloader(self) -> object | None: ...

    @property
    def sync_gradients(self) -> bool: ...


class SavePoints:
    """Which step boundaries are *save points*: where the state is the state after a whole
    loop body, so that a run resumed from a save made there replays exactly what follows.

    A save point is a prepared dataloader asked for its next batch (or to start a pass): the
    loader whose batches the optimizer steps on (the one iterated at the last optimizer step;
    any loader before the first step), after an optimizer step since the previous save point,
    with no accumulated gradients. So never between ``optimizer.step()`` and
    ``scheduler.step()``, never inside an evaluation pass, and never right after a pass's last
    batch, where the script's epoch-end code (evaluation, logging) still has to run: the next
    pass's start is the save point then.

    Feed it every boundary (:meth:`reached`); each user (the preemption save, the memory tier's
    snapshots) keeps its own instance.

    Args:
        gradient_state: the run's ``GradientState``.
    """

    def __init__(self, gradient_state: _StepState) -> None:
        self.gradient_state = gradient_state
        self.steps_at_point: int | None = None  # optimizer steps at the last save point
        self.training_loader: object | None = None  # the loader iterated at the last step

    def is_training(self, source: object) -> bool:
        """Whether a boundary of ``source`` is one of the training loader's (any loader's,
        before the first optimizer step)."""
        return self.training_loader is None or source is self.training_loader

    def reached(self, where: str, source: object) -> bool:
        """Report the boundary ``where``, ``source`` (see :class:`StepBoundary`); whether it
        is a save point."""
        if where == "step":
            self.training_loader = self.gradient_state.active_dataloader
            return False
        if where != "batch" or not self.is_training(source):
            return False
        steps = self.gradient_state.optimizer_steps
        stepped = steps != self.steps_at_point
        self.steps_at_point = steps
        return stepped and self.gradient_state.sync_gradients
