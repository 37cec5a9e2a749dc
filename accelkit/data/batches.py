"""Nested batches: their structure, their slices and their batch size.

The helpers that dispatching (:mod:`accelkit.data.dispatch`) needs, kept below it so that the data
path never imports :mod:`accelkit.utils`; :mod:`accelkit.utils` re-exports them under the
reference's names (``accelerate.utils.get_data_structure``...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from accelkit.errors import ConfigurationError
from accelkit.runtime.ops import recursively_apply

__all__ = [
    "TensorInformation",
    "find_batch_size",
    "get_data_structure",
    "initialize_tensors",
    "is_tensor_information",
    "slice_tensors",
]


@dataclasses.dataclass
class TensorInformation:
    """The shape and dtype of a tensor, to allocate a matching one on another process."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """The nested structure of ``data`` with each tensor replaced by its
    :class:`TensorInformation`."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors (on the CPU) for a structure made by :func:`get_data_structure`."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def slice_tensors(
    data: Any,
    tensor_slice: slice | int,
    process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """``tensor[tensor_slice]`` for every tensor in a nested structure.

    ``process_index``/``num_processes`` are accepted for compatibility and unused.
    """
    return recursively_apply(lambda t: t[tensor_slice], data)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in a nested structure.

    Raises:
        ValueError: when the structure holds no tensor.
    """
    if isinstance(data, torch.Tensor):
        return int(data.shape[0])
    values = data.values() if isinstance(data, Mapping) else data
    if isinstance(values, (list, tuple)) or isinstance(data, Mapping):
        for item in values:
            try:
                return find_batch_size(item)
            except ValueError:
                continue
    raise ConfigurationError(
        f"Cannot find the batch size of {type(data).__name__}: it holds no tensor."
    )
