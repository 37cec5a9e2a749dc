"""The reference's ``accelerate.utils.operations``: collectives and nested-tensor helpers."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from accelkit.ops import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    concatenate,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)
from accelkit.precision import convert_outputs_to_fp32
from accelkit.utils.other import (
    convert_to_fp32,
    find_batch_size,
    find_device,
    honor_type,
    ignorant_find_batch_size,
    is_namedtuple,
    is_torch_tensor,
    listify,
)

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "TensorInformation",
    "get_data_structure",
    "initialize_tensors",
    "is_tensor_information",
    "slice_tensors",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "honor_type",
    "ignorant_find_batch_size",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
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
