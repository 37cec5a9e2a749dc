"""find_executable_batch_size and release_memory (accelkit.utils.memory)."""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator

import pytest
import torch

from accelkit import find_executable_batch_size
from accelkit.utils import release_memory, should_reduce_batch_size


@pytest.fixture(autouse=True)
def _frozen_heap() -> Iterator[None]:
    """What the test process held before the test, out of the collector's sight while it runs.

    find_executable_batch_size and release_memory collect garbage before every try, as they
    should; in a suite's worker that already imported every tracker SDK, transformers and
    accelerate, each full collection walked millions of objects that none of these tests made
    (1-2 s each under load: this module took 93 s of the suite). The collections still run,
    over what the test makes."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_shrinks_by_ten_percent_until_it_fits_and_remembers() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=20)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 15:
            raise _oom()
        return batch_size * scale

    assert train(2) == 28
    assert tried == [20, 18, 16, 14]
    assert train(1) == 14  # the second call starts from the size that worked
    assert tried[-1] == 14


def test_custom_reduction_and_cpu_allocator_errors() -> None:
    sizes = iter([7, 3])

    @find_executable_batch_size(starting_batch_size=10, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size: int) -> int:
        if batch_size > 3:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 1 GB")
        return batch_size

    assert train() == 3


def test_other_errors_propagate_at_once() -> None:
    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> None:
        calls.append(batch_size)
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        train()
    assert calls == [8]


def test_gives_up_at_zero_and_refuses_an_explicit_batch_size() -> None:
    @find_executable_batch_size(starting_batch_size=2)
    def train(batch_size: int) -> None:
        raise _oom()

    with pytest.raises(RuntimeError, match="No executable batch size found"):
        train()

    @find_executable_batch_size(starting_batch_size=2)
    def train2(batch_size: int, lr: float) -> None: ...

    with pytest.raises(TypeError, match="Batch size was passed into `train2`"):
        train2(4, 0.1)


def test_release_memory_returns_one_none_per_object() -> None:
    a, b = torch.ones(3), torch.nn.Linear(2, 2)
    a, b = release_memory(a, b)
    assert (a, b) == (None, None)


# Out-of-memory messages of each backend, and errors that only look alike.
_MESSAGES = [
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "HIP out of memory. Tried to allocate 2.00 GiB",
    "XPU out of memory. Tried to allocate 2.00 GiB",
    "NPU out of memory. Tried to allocate 2.00 GiB",
    "Allocation on device 0 would exceed allowed memory. (out of memory.)",
    "MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 0 bytes)",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed: out of device memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ...",
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB",
    "shape mismatch: out of memory budget",
    "Expected all tensors to be on the same device",
]


@pytest.mark.parametrize("message", _MESSAGES)
def test_retries_on_the_errors_accelerate_retries_on(message: str) -> None:
    accelerate_memory = pytest.importorskip("accelerate.utils.memory")
    expected = accelerate_memory.should_reduce_batch_size(RuntimeError(message))
    assert should_reduce_batch_size(RuntimeError(message)) is expected
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size == 8:
            raise RuntimeError(message)
        return batch_size

    if expected:
        assert train() == 7 and tried == [8, 7]
    else:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            train()
        assert tried == [8]
