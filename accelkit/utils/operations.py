"""The reference's ``accelerate.utils.operations``: collectives and nested-tensor helpers."""

from __future__ import annotations

from accelkit.data.batches import (
    TensorInformation,
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    is_tensor_information,
    slice_tensors,
)
from accelkit.runtime.ops import (
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
from accelkit.training.precision import convert_outputs_to_fp32
from accelkit.utils.other import (
    convert_to_fp32,
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
