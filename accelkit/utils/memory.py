"""Freeing accelerator memory, and retrying a function with a smaller batch size on OOM."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from accelkit.errors import UsageError, WrongTypeError

__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]

# Messages PyTorch's allocators put in out-of-memory errors that are not
# torch.OutOfMemoryError (a cuDNN / CPU allocator failure surfaces as a RuntimeError). The list
# is Accelerate's (should_reduce_batch_size), so a run retries on the same failures on either.
_OOM_MARKERS = (
    " out of memory.",  # CUDA, HIP, XPU and NPU: "<device> out of memory. Tried to allocate ..."
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU (Gaudi)
    "CUDA error: out of memory",  # an asynchronous CUDA OOM, reported without the period
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Release cached accelerator memory (after a garbage collection, if asked)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references to ``objects`` and release cached memory.

    Returns:
        A list of ``None`` of the same length; assign it back so that your names drop the
        objects too: ``model, optimizer = release_memory(model, optimizer)``.
    """
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error that a smaller batch may avoid."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(marker in str(exception.args[0]) for marker in _OOM_MARKERS)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, ...)``, shrinking ``batch_size`` after each OOM.

    The decorated function takes the batch size as its first argument; callers leave it out.
    Memory is released before every retry. As in the reference, the batch size shrinks by 10%
    (``int(size * 0.9)``) per failure, and the decorated function remembers the last size that
    was tried, so a second call starts there.

    Args:
        function: the function (omit it to write
            ``@find_executable_batch_size(starting_batch_size=64)``).
        starting_batch_size: the first batch size tried.
        reduce_batch_size_fn: a function of no arguments returning the next batch size to try
            (default: 90% of the current one).

    Raises:
        TypeError: if the caller passes the batch size itself.
        RuntimeError: when the batch size reaches 0 without a successful call.

    Example:
        >>> @find_executable_batch_size(starting_batch_size=128)
        ... def train(batch_size, model, optimizer):
        ...     ...
        >>> train(model, optimizer)
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def shrink() -> int:
        return int(batch_size * 0.9)

    reduce_fn = reduce_batch_size_fn or shrink

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:]))
            raise WrongTypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when "
                f"called. Remove it and call `{function.__name__}({passed})` instead."
            )
        while True:
            if batch_size == 0:
                raise UsageError(
                    f"No executable batch size found for {function.__name__}: reached zero "
                    f"starting from {starting_batch_size}."
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce_fn()

    return decorator
