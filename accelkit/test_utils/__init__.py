"""Helpers for testing training scripts, importable as ``accelerate.test_utils``'s are.

A tiny regression problem (:class:`RegressionDataset`, :class:`RegressionModel`) whose training
result is easy to compare between one process and many, a cross-process equality check
(:func:`are_the_same_tensors`), and the ``require_*`` skip decorators of
:mod:`accelkit.test_utils.testing`. Nothing here is imported by accelkit itself.
"""

from __future__ import annotations

from accelkit.test_utils.testing import (
    are_the_same_tensors,
    assert_exception,
    require_bnb,
    require_cpu,
    require_cuda,
    require_multi_device,
    require_multi_gpu,
    require_non_cpu,
    require_single_device,
    require_single_gpu,
)
from accelkit.test_utils.training import RegressionDataset, RegressionModel

__all__ = [
    "RegressionDataset",
    "RegressionModel",
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
