"""Turning logged values and run configurations into what backends can store.

Two jobs:

* :func:`snapshot` runs on the caller's thread inside ``Accelerator.log``. It must be cheap and
  must make the values independent of the training step that follows: a one-element CPU tensor
  becomes a Python number, a larger tensor is copied, a CUDA tensor is copied on its stream and
  read by the tracker's worker after an event says the copy is done (the caller never waits
  for the GPU).
* :func:`to_plain` and :func:`flatten` turn a configuration holding nested dicts, lists,
  tensors, paths, enums and ``None`` into JSON-like data and flat ``"a/b"`` keys.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accelkit.errors import WrongTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["PLAIN_TYPES", "flatten", "is_number", "resolve", "snapshot", "to_plain"]

_PLAIN_TYPES = (float, int, str, bool, type(None))
_PLAIN_SET: frozenset[type] = frozenset(_PLAIN_TYPES)
PLAIN_TYPES: frozenset[type] = _PLAIN_SET
"""The exact types a value is stored as it is (``type(value) in PLAIN_TYPES``: a fast check
that leaves subclasses, such as numpy's ``float64``, to :func:`to_plain`)."""


_Types = tuple[Any, Any, Any]  # each a type, or None
_found: _Types | None = None  # set once both packages are imported


def _tensor_types() -> _Types:
    """torch's ``Tensor`` and numpy's ``generic`` and ``ndarray``, each ``None`` while its
    package is not imported (no value can be one then): the journal's readers, such as
    ``accelkit track status``, start without paying for torch's import (1-2 s)."""
    global _found
    if _found is not None:
        return _found
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    types = (
        getattr(torch, "Tensor", None),
        getattr(numpy, "generic", None),
        getattr(numpy, "ndarray", None),
    )
    if None not in types:
        _found = types
    return types


class _PendingDeviceTensor:
    """A device tensor copied on its stream; :func:`resolve` reads it once the copy is done."""

    __slots__ = ("event", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        import torch

        self.tensor = tensor.detach().clone()
        self.event = torch.cuda.Event()
        self.event.record()

    def read(self) -> Any:
        self.event.synchronize()
        if self.tensor.numel() == 1:
            return self.tensor.item()
        return self.tensor.cpu()


def _snapshot_value(value: Any) -> tuple[Any, bool]:
    """Copy one non-plain value; the flag says whether :func:`resolve` must finish it."""
    tensor, generic, ndarray = _tensor_types()
    if tensor is not None and isinstance(value, tensor):
        if value.device.type == "cpu":
            if value.numel() == 1:
                return value.item(), False
            return value.detach().clone(), False
        if value.device.type == "cuda":
            return _PendingDeviceTensor(value), True
        # Other accelerators: a synchronous copy is the safe choice.
        return _snapshot_value(value.detach().cpu())
    if generic is not None and isinstance(value, generic):
        return value.item(), False
    if ndarray is not None and isinstance(value, ndarray):
        return value.copy(), False
    if isinstance(value, Mapping):
        return snapshot(value)
    if isinstance(value, (list, tuple)):
        items = [_snapshot_value(v) if type(v) not in _PLAIN_SET else (v, False) for v in value]
        return [v for v, _ in items], any(flag for _, flag in items)
    return value, False


def snapshot(values: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Copy ``values`` so that the training loop may change or free them right away.

    Args:
        values: what the user passed to ``log``.

    Returns:
        The copied dict and whether it holds device tensors that :func:`resolve` must read.

    Raises:
        TypeError: ``values`` is not a mapping.
    """
    # `type(...) is dict` first: an ABC isinstance check costs microseconds with cold caches.
    if type(values) is not dict and not isinstance(values, Mapping):
        raise WrongTypeError(
            f"log() takes a dict of metric name -> value, got {type(values).__name__}: "
            f"{values!r}. Pass for example {{'loss': loss}}."
        )
    out: dict[str, Any] = {}
    pending = False
    for key, value in values.items():
        if type(value) in _PLAIN_SET:
            out[key] = value
        else:
            out[key], flag = _snapshot_value(value)
            pending = pending or flag
    return out, pending


def resolve(value: Any) -> Any:
    """Replace the pending device copies made by :func:`snapshot` by CPU values."""
    if isinstance(value, _PendingDeviceTensor):
        return value.read()
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v) for v in value]
    return value


def is_number(value: Any) -> bool:
    """True for ints, floats and bools that every metrics backend stores as a number."""
    return isinstance(value, (int, float))


def to_plain(value: Any) -> Any:
    """Turn a configuration into JSON-like data (dicts, lists, str, numbers, bool, ``None``).

    Tensors and arrays become numbers or lists, paths and unknown objects their ``str``, enums
    their value, dataclasses and namespaces their fields; non-finite floats stay floats.
    """
    if isinstance(value, _PLAIN_TYPES):
        return value
    tensor, generic, ndarray = _tensor_types()
    if tensor is not None and isinstance(value, tensor):
        value = value.detach().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    if generic is not None and isinstance(value, generic):
        return value.item()
    if ndarray is not None and isinstance(value, ndarray):
        return value.tolist()
    if isinstance(value, enum.Enum):
        return to_plain(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [to_plain(v) for v in items]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_plain(dataclasses.asdict(value))
    if hasattr(value, "__dict__") and type(value).__name__ == "Namespace":
        return to_plain(vars(value))
    return str(value)


def flatten(config: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """Flatten nested dicts of a plain configuration into ``"outer/inner"`` keys.

    Args:
        config: a configuration (it goes through :func:`to_plain` first).
        sep: the separator between nested keys.

    Returns:
        A flat dict whose values are str, numbers, bool, ``None`` or lists.
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, child in node.items():
                walk(f"{prefix}{sep}{key}" if prefix else str(key), child)
        else:
            flat[prefix] = node

    walk("", to_plain(config))
    return flat


def scalar_or_text(value: Any) -> int | float | str | bool:
    """A flat config value as a number/bool/str (lists and ``None`` become their text)."""
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return "None" if value is None else str(value)
