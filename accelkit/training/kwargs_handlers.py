"""Kwargs handlers: extra arguments for objects the ``Accelerator`` creates for you.

Pass instances in ``Accelerator(kwargs_handlers=[...])``, as with the reference::

    Accelerator(
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(init_scale=1024), DistributedDataParallelKwargs(
            find_unused_parameters=True)],
    )

Only the fields you change are passed on, so PyTorch's own defaults apply to the rest.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import Any

import torch

from accelkit.errors import ConfigurationError
from accelkit.runtime.environment import clear_environment

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "register_comm_hook",
]


class KwargsHandler:
    """Base of the kwargs handlers: :meth:`to_kwargs` returns the fields that differ from the
    defaults."""

    def to_dict(self) -> dict[str, Any]:
        """Every field and its value (a handler may report a field as a plain value)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        """The fields set to something other than their default, as :meth:`to_dict` reports
        them.

        The default is the class built with an empty environment, as in Accelerate: a value a
        handler read from an environment variable (``ACCELERATE_DYNAMO_MODE``, ...) is one the
        launch set, so it is passed on, not mistaken for the default.
        """
        with clear_environment():
            default = type(self)().to_dict()
        return {name: value for name, value in self.to_dict().items() if default[name] != value}


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of the fp16 ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


class DDPCommunicationHookType(str, enum.Enum):
    """Gradient communication hooks ``DistributedDataParallel`` can use (``register_comm_hook``).

    ``FP16``/``BF16`` compress gradients to half precision for the all-reduce; ``POWER_SGD`` and
    ``BATCHED_POWER_SGD`` are PyTorch's low-rank compression hooks (they take
    ``comm_state_option``, e.g. ``{"matrix_approximation_rank": 2}``).
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


_COMM_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of ``torch.nn.parallel.DistributedDataParallel`` and its communication hook.

    Args:
        comm_hook: a :class:`DDPCommunicationHookType` registered on the wrapped model.
        comm_wrapper: ``FP16``/``BF16`` compression around a PowerSGD hook (``NO`` otherwise).
        comm_state_option: options of the PowerSGD state (``matrix_approximation_rank``, ...).
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        if self.comm_wrapper not in (
            DDPCommunicationHookType.NO,
            DDPCommunicationHookType.FP16,
            DDPCommunicationHookType.BF16,
        ):
            raise ConfigurationError(
                f"comm_wrapper={self.comm_wrapper.value!r} is not a wrapper; expected 'no', "
                "'fp16' or 'bf16' (wrapping a 'power_sgd' / 'batched_power_sgd' comm_hook)."
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        """The changed arguments of the ``DistributedDataParallel`` constructor only."""
        return {k: v for k, v in self.to_kwargs().items() if k not in _COMM_FIELDS}

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        """Register the configured hook on a ``DistributedDataParallel`` model (see
        :func:`register_comm_hook`)."""
        register_comm_hook(model, self.comm_hook, self.comm_wrapper, self.comm_state_option)


def _hook_type(value: Any, name: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(value)
    except ValueError:
        accepted = ", ".join(repr(t.value) for t in DDPCommunicationHookType)
        raise ConfigurationError(f"Unknown {name} {value!r}. Expected one of {accepted}.") from None


def register_comm_hook(
    model: torch.nn.Module,
    hook: DDPCommunicationHookType,
    wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO,
    state_options: dict[str, Any] | None = None,
) -> None:
    """Register a DDP communication hook on ``model``; a no-op for ``NO`` or a non-DDP model.

    Args:
        model: the prepared model (hooks exist only on ``DistributedDataParallel``).
        hook: which hook.
        wrapper: ``FP16``/``BF16`` compression around a PowerSGD hook.
        state_options: PowerSGD state options.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    if hook is DDPCommunicationHookType.NO or not isinstance(model, DistributedDataParallel):
        return
    state: Any = None
    if hook is DDPCommunicationHookType.FP16:
        fn: Any = default_hooks.fp16_compress_hook
    elif hook is DDPCommunicationHookType.BF16:
        fn = default_hooks.bf16_compress_hook
    else:
        fn = (
            powerSGD_hook.powerSGD_hook
            if hook is DDPCommunicationHookType.POWER_SGD
            else powerSGD_hook.batched_powerSGD_hook
        )
        state = powerSGD_hook.PowerSGDState(process_group=None, **(state_options or {}))
        if wrapper is DDPCommunicationHookType.FP16:
            fn = default_hooks.fp16_compress_wrapper(fn)
        elif wrapper is DDPCommunicationHookType.BF16:
            fn = default_hooks.bf16_compress_wrapper(fn)
    model.register_comm_hook(state, fn)


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments of ``torch.distributed.init_process_group`` for the group the accelerator creates.

    ``backend`` defaults to ``"nccl"`` as in the reference, which means "the default": gloo on
    the CPU, NCCL on CUDA; set another value to choose it explicitly.
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of ``torch.autocast`` for :meth:`Accelerator.autocast`."""

    enabled: bool = True
    cache_enabled: bool | None = None


def collect(handlers: list[Any], kind: type[KwargsHandler]) -> dict[str, Any]:
    """The merged ``to_kwargs()`` of every handler of type ``kind`` in ``handlers``.

    For :class:`DistributedDataParallelKwargs` only the constructor's arguments are merged (the
    hook fields are applied by :func:`register_comm_hook` after wrapping).
    """
    out: dict[str, Any] = {}
    for handler in handlers:
        if isinstance(handler, DistributedDataParallelKwargs) and kind is type(handler):
            out.update(handler.ddp_kwargs())
        elif isinstance(handler, kind):
            out.update(handler.to_kwargs())
    return out


def find(handlers: list[Any], kind: type[Any]) -> Any:
    """The last handler of type ``kind`` in ``handlers``, or None."""
    found = [h for h in handlers if isinstance(h, kind)]
    return found[-1] if found else None
