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

__all__ = ["BoundaryHook", "StepBoundary"]

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
