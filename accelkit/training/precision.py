"""Mixed precision: autocast contexts, the autocast model forward, and the fp16 grad scaler.

``"bf16"`` autocasts to bfloat16 on CPU and CUDA and needs no loss scaling. ``"fp16"`` autocasts
to float16 and scales the loss with :class:`torch.amp.GradScaler` so small gradients do not
underflow; on CUDA that is the usual setup, and on CPU (recent PyTorch supports float16 CPU
autocast and a CPU grad scaler) it works the same, only slowly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from accelkit.errors import ConfigurationError
from accelkit.runtime.ops import recursively_apply

__all__ = [
    "AutocastForward",
    "autocast_context",
    "autocast_dtype",
    "convert_outputs_to_fp32",
    "get_grad_scaler",
    "get_mixed_precision_context_manager",
    "outputs_to_fp32",
    "make_grad_scaler",
]

_DTYPES = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The autocast dtype of a mixed-precision mode (None for ``"no"``).

    Raises:
        ValueError: for an unknown mode.
    """
    try:
        return _DTYPES[mixed_precision]
    except KeyError:
        raise ConfigurationError(
            f"Unknown mixed_precision {mixed_precision!r}. Expected one of 'no', 'fp16', 'bf16'."
        ) from None


def autocast_context(
    mixed_precision: str, device: torch.device, **kwargs: Any
) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.autocast`` block for ``mixed_precision`` on ``device`` (a no-op for ``"no"``).

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        device: the device whose type autocast targets.
        **kwargs: passed to ``torch.autocast`` (e.g. ``enabled=False`` to return to fp32,
            ``cache_enabled``).
    """
    dtype = autocast_dtype(mixed_precision)
    if dtype is None and not kwargs:
        return contextlib.nullcontext()
    kwargs.setdefault("dtype", dtype or torch.float32)
    if dtype is None:
        kwargs.setdefault("enabled", False)
    return torch.autocast(device_type=device.type, **kwargs)


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.float()
    return tensor


def outputs_to_fp32(outputs: Any) -> Any:
    """Cast every float16/bfloat16 tensor in a (nested) model output to float32."""
    if isinstance(outputs, torch.Tensor):
        return _to_fp32(outputs)
    return recursively_apply(_to_fp32, outputs)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that its float16/bfloat16 outputs come back as float32."""

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return outputs_to_fp32(model_forward(*args, **kwargs))

    return forward


class AutocastForward:
    """A model's ``forward`` run under autocast, with its outputs cast back to float32.

    ``prepare`` installs one as the model's instance attribute ``forward``; the original bound
    method stays in :attr:`__wrapped__` and ``unwrap_model(model, keep_fp32_wrapper=False)``
    removes the wrapper.
    """

    def __init__(self, forward: Callable[..., Any], device_type: str, dtype: torch.dtype) -> None:
        self.__wrapped__ = forward
        self.device_type = device_type
        self.dtype = dtype
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            outputs = self.__wrapped__(*args, **kwargs)
        return outputs_to_fp32(outputs)


def wrap_forward(model: torch.nn.Module, mixed_precision: str, device: torch.device) -> None:
    """Install :class:`AutocastForward` on ``model`` (once; a no-op for ``"no"``)."""
    dtype = autocast_dtype(mixed_precision)
    if dtype is None or isinstance(model.__dict__.get("forward"), AutocastForward):
        return
    model.forward = AutocastForward(model.forward, device.type, dtype)


def unwrap_forward(model: torch.nn.Module) -> None:
    """Remove an :class:`AutocastForward` installed by :func:`wrap_forward`."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, AutocastForward):
        del model.__dict__["forward"]


def make_grad_scaler(
    mixed_precision: str, device: torch.device, **kwargs: Any
) -> torch.amp.GradScaler | None:
    """The grad scaler for ``"fp16"`` (None for other modes).

    Args:
        mixed_precision: the mode.
        device: the device whose type the scaler works on.
        **kwargs: ``torch.amp.GradScaler`` options (``init_scale``, ``growth_interval``, ...).
    """
    if mixed_precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, **kwargs)


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for this machine's device (CUDA when available, else the CPU).

    ``distributed_type`` is accepted for compatibility (FSDP2 uses the same scaler).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.amp.GradScaler(device, **kwargs)


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: Any = None
) -> contextlib.AbstractContextManager[Any]:
    """The autocast block of the current run's mixed precision (a null context without it).

    Args:
        native_amp: whether mixed precision is on.
        autocast_kwargs: an ``AutocastKwargs`` (or dict) of ``torch.autocast`` overrides.
    """
    if not native_amp:
        return contextlib.nullcontext()
    from accelkit.runtime.environment import parse_mixed_precision

    overrides = autocast_kwargs.to_kwargs() if hasattr(autocast_kwargs, "to_kwargs") else {}
    if isinstance(autocast_kwargs, dict):
        overrides = dict(autocast_kwargs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return autocast_context(parse_mixed_precision(None).value, device, **overrides)
