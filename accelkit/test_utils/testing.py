"""Assertions and skip decorators for tests of distributed training code."""

from __future__ import annotations

import contextlib
import importlib.util
import unittest
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from accelkit.runtime.ops import gather

__all__ = [
    "are_the_same_tensors",
    "assert_exception",
    "require_bnb",
    "require_cpu",
    "require_cuda",
    "require_multi_device",
    "require_multi_gpu",
    "require_non_cpu",
    "require_single_device",
    "require_single_gpu",
]

T = TypeVar("T")


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has the same value on every process (a collective)."""
    from accelkit.runtime.state import PartialState

    device = PartialState().device
    local = tensor[None].clone().to(device)
    everyone = gather(local).cpu()
    return all(torch.equal(everyone[i], local[0].cpu()) for i in range(everyone.shape[0]))


@contextlib.contextmanager
def assert_exception(
    exception_class: type[BaseException], msg: str | None = None
) -> Iterator[None]:
    """Assert that the block raises ``exception_class`` (with ``msg`` in its text, if given).

    Raises:
        AssertionError: when the block raises nothing, or something else.
    """
    try:
        yield
    except exception_class as exc:
        if msg is not None and msg not in str(exc):
            raise AssertionError(
                f"{exception_class.__name__} raised without {msg!r}: {exc}"
            ) from exc
        return
    except Exception as exc:
        raise AssertionError(
            f"Expected {exception_class.__name__}, but {type(exc).__name__} was raised: {exc}"
        ) from exc
    raise AssertionError(f"Expected {exception_class.__name__} to be raised; nothing was.")


def _skip_unless(condition: bool, reason: str) -> Callable[[T], T]:
    return unittest.skipUnless(condition, reason)  # type: ignore[return-value]


def require_cpu(test_case: T) -> T:
    """Skip unless no CUDA device is visible."""
    return _skip_unless(not torch.cuda.is_available(), "test requires only a CPU")(test_case)


def require_non_cpu(test_case: T) -> T:
    """Skip unless an accelerator (CUDA) is available."""
    return _skip_unless(torch.cuda.is_available(), "test requires a GPU")(test_case)


def require_cuda(test_case: T) -> T:
    """Skip unless CUDA is available."""
    return _skip_unless(torch.cuda.is_available(), "test requires CUDA")(test_case)


def require_single_gpu(test_case: T) -> T:
    """Skip unless exactly one CUDA device is visible."""
    return _skip_unless(torch.cuda.device_count() == 1, "test requires one GPU")(test_case)


require_single_device = require_single_gpu


def require_multi_gpu(test_case: T) -> T:
    """Skip unless several CUDA devices are visible."""
    return _skip_unless(torch.cuda.device_count() > 1, "test requires several GPUs")(test_case)


require_multi_device = require_multi_gpu


def require_bnb(test_case: T) -> T:
    """Skip unless bitsandbytes is installed."""
    available = importlib.util.find_spec("bitsandbytes") is not None
    return _skip_unless(available, "test requires bitsandbytes")(test_case)
