"""Wrapped optimizers and schedulers, and the gradient-accumulation state they share.

:class:`GradientState` is one small object per :class:`~accelkit.Accelerator`, handed explicitly
to every prepared optimizer, scheduler and dataloader (there is no process-wide singleton). It
answers two questions on every micro-step: "do gradients synchronise now?" (``sync_gradients``)
and "is the active dataloader on its last batch?" (``end_of_dataloader``).

:class:`AcceleratedOptimizer` skips ``step()``/``zero_grad()`` while gradients accumulate and
drives the fp16 grad scaler; :class:`AcceleratedScheduler` steps only when the optimizer did.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from typing_extensions import override

from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.training.boundary import StepBoundary

__all__ = [
    "AcceleratedOptimizer",
    "AcceleratedScheduler",
    "GradientAccumulationPlugin",
    "GradientState",
    "resolve_plugin",
]


@dataclasses.dataclass
class GradientAccumulationPlugin:
    """How gradients accumulate over micro-steps.

    Args:
        num_steps: micro-steps per optimizer step (``>= 1``).
        adjust_scheduler: count the accumulating micro-steps in the scheduler's ``_step_count``
            (as the reference does; only PyTorch's "step before optimizer.step" bookkeeping sees
            it).
        sync_with_dataloader: force a synchronising step on the last batch of the dataloader,
            even when it does not complete ``num_steps`` micro-steps.
        sync_each_batch: all-reduce gradients on every micro-step instead of only the last one
            (less memory, more communication).
    """

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ConfigurationError(
                f"gradient accumulation num_steps={self.num_steps!r} must be an integer >= 1; "
                "use 1 to step the optimizer on every batch."
            )


def resolve_plugin(
    plugin: GradientAccumulationPlugin | None, gradient_accumulation_steps: int = 1
) -> GradientAccumulationPlugin:
    """The effective accumulation settings from ``Accelerator``'s two ways of giving them.

    Raises:
        ValueError: if both are given, or the step count is invalid.
        TypeError: if ``plugin`` is not a :class:`GradientAccumulationPlugin`.
    """
    if plugin is None:
        return GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise WrongTypeError(
            f"gradient_accumulation_plugin must be a GradientAccumulationPlugin, got "
            f"{type(plugin).__name__}."
        )
    if gradient_accumulation_steps != 1:
        raise ConfigurationError(
            f"Got gradient_accumulation_steps={gradient_accumulation_steps} and a "
            f"gradient_accumulation_plugin (num_steps={plugin.num_steps}); give only one of them."
        )
    return plugin


class _Loader(Protocol):
    @property
    def end_of_dataloader(self) -> bool: ...

    remainder: int


_CURRENT: weakref.ref[GradientState] | None = None


def _current_state() -> GradientState | None:
    """The process's current :class:`GradientState`, if one is alive."""
    return None if _CURRENT is None else _CURRENT()


class GradientState:
    """Shared accumulation state: one per accelerator, read by its optimizers and dataloaders.

    As in Accelerate, ``GradientState()`` without a plugin is the process's current state: the
    one the newest ``Accelerator`` made (or, without one, the first ``GradientState()``), so it
    sees that accelerator's ``num_steps`` and ``sync_gradients``. ``GradientState(plugin)``
    makes a new state and makes it current (each ``Accelerator`` does). The current state is
    held by a weak reference (it goes with its accelerator) and :meth:`_reset_state` forgets it.

    Attributes:
        num_steps: micro-steps per optimizer step.
        sync_gradients: True on the micro-step whose gradients are final (the optimizer steps).
        micro_step: micro-steps counted by :meth:`begin_micro_step` since the last reset (the
            reference's ``Accelerator.step``).
        optimizer_steps: optimizer steps actually taken (not skipped) so far.
        on_boundary: the step boundaries of the run (:class:`~.boundary.StepBoundary`): the
            prepared optimizers and dataloaders report them there; the accelerator's save
            decisions and preemption register their hooks there.
    """

    def __new__(
        cls, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None
    ) -> GradientState:
        current = _current_state()
        if gradient_accumulation_plugin is None and isinstance(current, cls):
            return current
        return super().__new__(cls)

    def __init__(
        self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None
    ) -> None:
        global _CURRENT
        if gradient_accumulation_plugin is None and _current_state() is self:
            return  # GradientState() is the current state, kept as it is
        _CURRENT = weakref.ref(self)
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin()
        self.plugin = plugin
        self.num_steps = plugin.num_steps
        self.sync_gradients = True
        self.micro_step = 0
        self.optimizer_steps = 0
        self.on_boundary = StepBoundary()
        self._loaders: list[_Loader] = []

    def __getnewargs__(self) -> tuple[Any, ...]:
        # A copy (pickle, copy) is a new object, never the current state.
        return (self.plugin,)

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the current state: the next ``GradientState()`` is a new one (the states
        accelerators hold are theirs and stay as they are)."""
        global _CURRENT
        _CURRENT = None

    @property
    def initialized(self) -> bool:
        """Always True (the reference's shared state could be uninitialised)."""
        return True

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether the end of a dataloader forces a gradient sync (the plugin's setting)."""
        return self.plugin.sync_with_dataloader

    @property
    def adjust_scheduler(self) -> bool:
        """Whether schedulers step once per optimizer step (the plugin's setting)."""
        return bool(getattr(self.plugin, "adjust_scheduler", True))

    @property
    def dataloader_references(self) -> list[_Loader | None]:
        """The dataloaders being iterated, outermost first (``[None]`` when none)."""
        return [None, *self._loaders]

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Always True: there is no XLA here (out of scope)."""
        return True

    @property
    def active_dataloader(self) -> _Loader | None:
        """The innermost dataloader being iterated, if any."""
        return self._loaders[-1] if self._loaders else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared dataloader is being iterated."""
        return bool(self._loaders)

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active dataloader has yielded its last batch."""
        return bool(self._loaders) and self._loaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last global batch (``-1`` unknown, 0 none added)."""
        return self._loaders[-1].remainder if self._loaders else -1

    def enter_loader(self, loader: _Loader) -> None:
        """Called by a prepared dataloader when an iteration starts."""
        self._loaders.append(loader)

    def exit_loader(self, loader: _Loader) -> None:
        """Called by a prepared dataloader when an iteration ends (or is abandoned)."""
        for i in range(len(self._loaders) - 1, -1, -1):
            if self._loaders[i] is loader:
                del self._loaders[i]
                return

    def begin_micro_step(self) -> bool:
        """Advance one micro-step and decide whether its gradients synchronise.

        Returns:
            The new :attr:`sync_gradients`.
        """
        if self.plugin.sync_with_dataloader and self.end_of_dataloader:
            self.micro_step = 0
            self.sync_gradients = True
        else:
            self.micro_step += 1
            self.sync_gradients = self.micro_step % self.num_steps == 0
        return self.sync_gradients

    def reset(self) -> None:
        """Forget all progress (used by ``Accelerator.free_memory``)."""
        self.sync_gradients = True
        self.micro_step = 0
        self.optimizer_steps = 0
        self._loaders.clear()


class AcceleratedOptimizer(torch.optim.Optimizer):
    """A prepared optimizer: the wrapped optimizer, stepped only when gradients are final.

    ``step()`` and ``zero_grad()`` do nothing on micro-steps where gradients still accumulate
    (``gradient_state.sync_gradients`` False). With an fp16 grad scaler, ``step()`` goes through
    ``scaler.step``/``scaler.update`` and :attr:`step_was_skipped` tells whether the scaler found
    inf/NaN gradients and skipped the update. Every other attribute (``param_groups``,
    ``state``, ``defaults``, custom ones) is the wrapped optimizer's.

    Args:
        optimizer: the optimizer to wrap.
        gradient_state: the accelerator's shared state.
        scaler: the grad scaler for fp16, or None.
        device: where to move the optimizer's state (None: leave it).

    Attributes:
        before_step: called before each synchronising ``step()`` when not ``None``: an
            overlapped asynchronous save (``ProjectConfiguration(async_snapshot=
            "overlapped")``) sets it to wait for its background copy of the parameters and
            optimizer state, and clears it once that copy is done.
    """

    before_step: Callable[[], None] | None = None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_state: GradientState,
        scaler: torch.amp.GradScaler | None = None,
        device: torch.device | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: all state lives in
        # ``self.optimizer``; subclassing only makes isinstance checks (LR schedulers) pass.
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self._step_was_skipped = False
        self._unscaled = False
        self.before_step = None
        if device is not None and device.type != "cpu" and optimizer.state:
            _move_state(optimizer, device)

    # -------------------------------------------------------------- passthrough

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found on the wrapper itself.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @override
    def __getstate__(self) -> dict[str, Any]:
        # An LR scheduler may have patched ``step`` on the instance; like torch, drop it.
        # The fence of an overlapped save (a bound method of this process's saver) too.
        return {k: v for k, v in self.__dict__.items() if k not in ("step", "before_step")}

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @override
    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    # --------------------------------------------------------------- the step

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, unless they are still accumulating."""
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @override
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the wrapped optimizer if gradients are final (through the scaler in fp16)."""
        if not self.gradient_state.sync_gradients:
            return None
        fence = self.before_step
        if fence is not None:
            fence()  # an overlapped save is still copying the tensors this step changes
        scaler = self.scaler
        if scaler is None:
            result = self.optimizer.step(closure)
        else:
            # The scaler lowers its scale exactly when it found inf/NaN and skipped the step.
            before = scaler.get_scale()
            result = (
                scaler.step(self.optimizer, closure) if closure else scaler.step(self.optimizer)
            )
            scaler.update()
            self._step_was_skipped = scaler.get_scale() < before
            self._unscaled = False
        if not self._step_was_skipped:
            self.gradient_state.optimizer_steps += 1
        on_boundary = self.gradient_state.on_boundary
        if on_boundary.hooks:
            on_boundary("step", self)
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last synchronising ``step()`` was skipped for inf/NaN gradients."""
        return self._step_was_skipped

    def unscale_(self) -> bool:
        """Divide this optimizer's gradients by the loss scale, once per optimizer step.

        Returns:
            True if the gradients were unscaled now, False if there is no scaler or they
            already were since the last step.
        """
        if self.scaler is None or self._unscaled:
            return False
        self.scaler.unscale_(self.optimizer)
        self._unscaled = True
        return True

    def train(self) -> None:
        """Forward ``train()`` to optimizers that have one (schedule-free optimizers)."""
        fn = getattr(self.optimizer, "train", None)
        if callable(fn):
            fn()

    def eval(self) -> None:
        """Forward ``eval()`` to optimizers that have one (schedule-free optimizers)."""
        fn = getattr(self.optimizer, "eval", None)
        if callable(fn):
            fn()


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)


class AcceleratedScheduler:
    """A prepared learning-rate scheduler that steps only when the optimizer did.

    With ``step_with_optimizer`` (the default), ``step()`` does nothing on accumulating
    micro-steps and after a step the grad scaler skipped. Unless ``split_batches`` is set it
    advances ``num_processes`` times per optimizer step, as the reference does: a schedule written
    for single-process steps (``num_training_steps = len(loader) * epochs`` measured before
    ``prepare``) then ends when training does, and warmup given as
    ``num_warmup_steps * num_processes`` lasts the intended number of optimizer steps.

    Args:
        scheduler: the scheduler to wrap.
        optimizers: the prepared optimizers it follows (their skip flags are checked).
        gradient_state: the accelerator's shared state.
        step_with_optimizer: follow the optimizer (False: ``step()`` always steps).
        split_batches: the batch size is split across processes (step once per step).
        num_processes: the number of processes.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: Iterable[AcceleratedOptimizer],
        gradient_state: GradientState,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        num_processes: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self._repeats = 1 if split_batches else num_processes
        self._total_steps = getattr(scheduler, "total_steps", None)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler when the optimizer stepped (see the class docstring)."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.plugin.adjust_scheduler and hasattr(
                self.scheduler, "_step_count"
            ):
                self.scheduler._step_count += 1
            return
        for opt in self.optimizers:
            if opt.step_was_skipped:
                return
        for _ in range(self._repeats):
            # OneCycleLR raises when stepped past total_steps (uneven last epoch); stop there.
            if self._total_steps is not None and self.scheduler._step_count > self._total_steps:
                return
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        """The learning rates of the last step."""
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        """The wrapped scheduler's ``get_lr()``."""
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``print_lr()``."""
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
