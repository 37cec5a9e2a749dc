"""``accelerate.utils.modeling``'s names, for scripts that import from that module path.

``from accelerate.utils.modeling import load_checkpoint_in_model`` ports as
``from accelkit.utils.modeling import load_checkpoint_in_model``. The names accelkit provides
are the ones :mod:`accelkit.utils` already exports, re-exported here (one object each):
:func:`load_checkpoint_in_model`, ``get_grad_scaler``, ``get_mixed_precision_context_manager``,
``is_peft_model`` and ``convert_file_size_to_int``. The module's big-model inference helpers
(device maps, offloading, module sizes: ``get_state_dict_from_offload``,
``infer_auto_device_map``, ...) import, and raise
:class:`~accelkit.out_of_scope.OutOfScopeError` saying why when used
(:data:`~accelkit.out_of_scope.OUT_OF_SCOPE` is their one list).
"""

from __future__ import annotations

from accelkit._lazy import lazy_getattr
from accelkit.checkpointing.formats.model_io import load_checkpoint_in_model
from accelkit.training.precision import get_grad_scaler, get_mixed_precision_context_manager
from accelkit.utils.other import convert_file_size_to_int, is_peft_model

__all__ = [
    "convert_file_size_to_int",
    "get_grad_scaler",
    "get_mixed_precision_context_manager",
    "is_peft_model",
    "load_checkpoint_in_model",
]

# The reference module's functions accelkit refuses (each an OUT_OF_SCOPE entry).
_REFUSED = (
    "align_module_device",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "dtype_byte_size",
    "fallback_allocate",
    "find_tied_parameters",
    "get_accelerator_free_memory",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "id_tensor_storage",
    "infer_auto_device_map",
    "load_offloaded_weights",
    "load_state_dict",
    "named_module_tensors",
    "normalize_device",
    "retie_parameters",
    "set_module_tensor_to_device",
)
__getattr__ = lazy_getattr(__name__, dict.fromkeys(_REFUSED, "accelkit.out_of_scope"))
