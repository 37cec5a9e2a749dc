"""Collectives over tensors and nested lists/tuples/dicts of tensors.

Every function works on one process too (it then returns its input, or a copy where the
multi-process result would be a new tensor), so a script behaves the same under
``python script.py`` and ``accelkit launch --num_processes N script.py``.

All communication is ``torch.distributed``; nothing here starts processes or owns state.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from accelkit.errors import AccelkitError, ConfigurationError, WrongTypeError
from accelkit.runtime.trail import entering

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "copy_tensor_to_devices",
    "debug_mode",
    "gather",
    "gather_object",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "set_debug_mode",
]

REDUCTIONS = ("sum", "mean", "max", "none")

# Debug mode (the reference's ``PartialState().debug``): collectives first check that every
# process passes tensors of matching shapes, and raise DistributedOperationException instead of
# hanging or returning garbage. It costs one extra object gather per call, so it is off unless
# ACCELKIT_DEBUG_MODE / ACCELERATE_DEBUG_MODE is set or a script sets ``state.debug = True``.
_DEBUG = {
    "on": any(
        os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"}
        for v in ("ACCELKIT_DEBUG_MODE", "ACCELERATE_DEBUG_MODE")
    )
}


class CannotPadNestedTensorWarning(UserWarning):
    """:func:`pad_across_processes` met a nested tensor, which it returns unpadded."""


class DistributedOperationException(AccelkitError):
    """A collective cannot run because the processes passed incompatible tensors (debug mode)."""


def debug_mode() -> bool:
    """Whether collectives check shapes across processes first (see :func:`set_debug_mode`)."""
    return _DEBUG["on"]


def set_debug_mode(enabled: bool) -> None:
    """Turn the cross-process shape checks of :func:`gather`, :func:`reduce`,
    :func:`broadcast` and :func:`pad_across_processes` on or off for this process."""
    _DEBUG["on"] = bool(enabled)


def _shapes(data: Any, ndim_only: bool) -> Any:
    def one(t: torch.Tensor) -> Any:
        return t.ndim if ndim_only else tuple(t.shape)

    if isinstance(data, torch.Tensor):
        return one(data)
    return recursively_apply(one, data)


def _verify(operation: str, data: Any, ndim_only: bool = False) -> None:
    if not debug_mode() or _world_size() == 1:
        return
    shapes = gather_object([_shapes(data, ndim_only)])
    if any(s != shapes[0] for s in shapes):
        what = "numbers of dimensions" if ndim_only else "shapes"
        listing = "\n".join(f"  process {i}: {s}" for i, s in enumerate(shapes))
        raise DistributedOperationException(
            f"Cannot apply {operation}: the tensors' {what} differ across processes; every "
            f"process must pass the same structure.\n{listing}"
        )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = _is_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every tensor in a nested list/tuple/dict.

    Named tuples and dict subclasses keep their type. Values that are not tensors (or for which
    ``test_type`` is false) are returned as they are, or raise ``TypeError`` with
    ``error_on_other_type=True``.
    """

    def again(value: Any) -> Any:
        return recursively_apply(
            func,
            value,
            *args,
            test_type=test_type,
            error_on_other_type=error_on_other_type,
            **kwargs,
        )

    if test_type(data):
        return func(data, *args, **kwargs)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(again(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(again(v) for v in data)
    if isinstance(data, Mapping):
        return cast(Any, type(data))({k: again(v) for k, v in data.items()})
    if error_on_other_type:
        raise WrongTypeError(
            f"Expected a tensor or a nested list/tuple/dict of tensors, found a "
            f"{type(data).__name__}: {data!r:.80}. Convert it with torch.tensor(...) first, or "
            "use gather_object for arbitrary Python objects."
        )
    return data


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: list[str] | str | None = None,
) -> Any:
    """Move every tensor in ``tensor`` (nested lists/tuples/dicts, or objects with ``.to``).

    Args:
        tensor: the data.
        device: where to.
        non_blocking: asynchronous copies (from pinned memory).
        skip_keys: keys of a dict whose values stay where they are (at every nesting level).
    """
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    if isinstance(tensor, Mapping) and skip:
        return cast(Any, type(tensor))(
            {
                k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                for k, v in tensor.items()
            }
        )
    if isinstance(tensor, (list, tuple)) and skip:
        moved = [send_to_device(v, device, non_blocking, skip_keys) for v in tensor]
        return type(tensor)(*moved) if hasattr(tensor, "_fields") else type(tensor)(moved)
    if isinstance(tensor, (torch.Tensor, list, tuple, Mapping)):
        return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), tensor)
    to = getattr(tensor, "to", None)
    if callable(to):  # e.g. a tokenizer's BatchEncoding
        return to(device)
    return tensor


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    world = _world_size()
    if world == 1:
        return tensor
    if tensor.ndim == 0:
        tensor = tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    # gloo has no all_gather for bool; round-trip through uint8.
    send = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    parts = [torch.empty_like(send) for _ in range(world)]
    with entering("all_gather (accelkit gather)"):
        dist.all_gather(parts, send)
    out = torch.cat(parts, dim=0)
    return out.to(torch.bool) if tensor.dtype == torch.bool else out


def gather(tensor: Any) -> Any:
    """Concatenate tensors from all processes on the first dimension.

    Every process gets the result. Tensors must have the same shape on every process (use
    :func:`pad_across_processes` first otherwise); scalars become 1-element tensors.

    Example:
        >>> gather(torch.tensor([rank]))  # on 4 processes
        tensor([0, 1, 2, 3])
    """
    _verify("gather", tensor)
    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


def gather_object(object: Any) -> list[Any]:
    """Gather picklable objects from all processes into one flat list.

    A list on each process is concatenated (``[a] + [b]``); any other object becomes one item per
    process. Only use it for objects you trust: it pickles.
    """
    world = _world_size()
    items = object if isinstance(object, list) else [object]
    if world == 1:
        return list(items)
    out: list[Any] = [None] * world
    with entering("all_gather_object (accelkit gather_object)"):
        dist.all_gather_object(out, items)
    return [item for part in out for item in part]


def _reduce_one(tensor: torch.Tensor, reduction: str, scale: float) -> torch.Tensor:
    out = tensor.clone()
    if _world_size() > 1 and reduction != "none":
        op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM
        with entering("all_reduce (accelkit reduce)"):
            dist.all_reduce(out, op=op)
        if reduction == "mean":
            out = out / _world_size()
    if scale != 1.0:
        out = out * scale
    return out


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce tensors across processes; every process gets the result.

    The default is ``"mean"``, as for the reference's ``accelerate.utils.reduce``
    (``Accelerator.reduce`` defaults to ``"sum"``, also as in the reference).

    Args:
        tensor: a tensor or a nested list/tuple/dict of tensors.
        reduction: ``"mean"``, ``"sum"``, ``"max"`` or ``"none"`` (no communication).
        scale: factor applied after the reduction. Unlike the reference, which silently
            ignores it everywhere but on XLA, accelkit applies it on every backend: a script
            passing ``scale=`` gets the scaled result it asked for.

    Raises:
        ValueError: for an unknown ``reduction``.

    Example:
        >>> reduce(torch.arange(2) + 1 + 2 * rank, "sum")  # on 2 processes
        tensor([4, 6])
    """
    if reduction not in REDUCTIONS:
        raise ConfigurationError(f"Unknown reduction {reduction!r}. Expected one of {REDUCTIONS}.")
    _verify("reduce", tensor)
    return recursively_apply(
        lambda t: _reduce_one(t, reduction, scale), tensor, error_on_other_type=True
    )


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy tensors from ``from_process`` to every process (in place; also returned).

    On one process ``tensor`` is returned as it is, non-tensor values included (as
    Accelerate does); on several, only tensors (in lists, tuples and dicts) can be sent.
    """

    def _one(t: torch.Tensor) -> torch.Tensor:
        with entering("broadcast (accelkit broadcast)"):
            dist.broadcast(t, src=from_process)
        return t

    if _world_size() <= 1:
        return tensor
    _verify("broadcast", tensor)
    return recursively_apply(_one, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace ``object_list``'s items in place with those of ``from_process`` (pickles)."""
    if _world_size() > 1:
        with entering("broadcast_object_list (accelkit broadcast_object_list)"):
            dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad tensors on ``dim`` to the largest size any process has, so they can be gathered.

    Example:
        >>> pad_across_processes(torch.arange(rank + 1))  # on 2 processes
        tensor([0, 0]) on rank 0, tensor([0, 1]) on rank 1
    """

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor; it is returned unpadded.",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return t
        if _world_size() == 1 or t.ndim == 0:
            return t
        if not -t.ndim <= dim < t.ndim:
            raise ConfigurationError(
                f"pad_across_processes: dim={dim} is out of range for a tensor of shape "
                f"{tuple(t.shape)}."
            )
        axis = dim % t.ndim
        size = torch.tensor([t.shape[axis]], device=t.device)
        max_size = int(_gather_one(size).max().item())
        if max_size == t.shape[axis]:
            return t
        new_shape = list(t.shape)
        new_shape[axis] = max_size
        out = t.new_full(new_shape, pad_index)
        index = [slice(None)] * t.ndim
        index[axis] = (
            slice(max_size - t.shape[axis], max_size) if pad_first else slice(0, t.shape[axis])
        )
        out[tuple(index)] = t
        return out

    _verify("pad_across_processes", tensor, ndim_only=True)
    return recursively_apply(_pad, tensor, error_on_other_type=True)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Give every process a copy of the main process's tensor.

    Only the main process passes ``tensor``; the others pass None (they learn its shape and
    dtype from the main process). A one-process run returns ``tensor``.

    Raises:
        ValueError: on the main process, when ``tensor`` is None.
    """
    world = _world_size()
    is_main = world == 1 or dist.get_rank() == 0
    if is_main and tensor is None:
        raise ConfigurationError(
            "copy_tensor_to_devices needs the tensor on the main process (rank 0)."
        )
    if world == 1:
        return cast(torch.Tensor, tensor)
    meta = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
    dist.broadcast_object_list(meta, src=0)
    shape, dtype = meta[0]  # type: ignore[misc]
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )
    out = (
        tensor.to(device) if tensor is not None else torch.empty(shape, dtype=dtype, device=device)
    )
    dist.broadcast(out, src=0)
    return out


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of equally structured nested tensors along ``dim``."""
    if not data:
        raise ConfigurationError("concatenate needs a non-empty list.")
    first = data[0]
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate([d[i] for d in data], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return cast(Any, type(first))({k: concatenate([d[k] for d in data], dim) for k in first})
    if not isinstance(first, torch.Tensor):
        raise WrongTypeError(f"Can only concatenate tensors, found {type(first).__name__}.")
    return torch.cat(data, dim=dim)
