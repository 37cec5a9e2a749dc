"""Everything scripts written for the reference import from ``accelerate.utils``.

``from accelerate.utils import set_seed, ProjectConfiguration`` ports as
``from accelkit.utils import set_seed, ProjectConfiguration``. Names are resolved on first use,
so importing this package stays cheap. ``tests/compat/test_public_names.py`` checks this list
against the installed reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr
from accelkit.out_of_scope import OUT_OF_SCOPE

_IMPORTS = "accelkit.utils.imports"
_CONSTANTS = "accelkit.utils.constants"
_OTHER = "accelkit.utils.other"

_PUBLIC = {
    "GeneralTracker": "accelkit.trackers",
    "register_tracker": "accelkit.trackers",
    "LoggerType": "accelkit.trackers",
    "AutocastKwargs": "accelkit.kwargs_handlers",
    "DDPCommunicationHookType": "accelkit.kwargs_handlers",
    "DistributedDataParallelKwargs": "accelkit.kwargs_handlers",
    "GradScalerKwargs": "accelkit.kwargs_handlers",
    "InitProcessGroupKwargs": "accelkit.kwargs_handlers",
    "KwargsHandler": "accelkit.kwargs_handlers",
    "ProfileKwargs": "accelkit.profiling",
    "PROFILE_PATTERN_NAME": "accelkit.profiling",
    "DynamoBackend": "accelkit.dynamo",
    "TorchDynamoPlugin": "accelkit.dynamo",
    "GradientAccumulationPlugin": "accelkit.optim",
    "DistributedOperationException": "accelkit.ops",
    "broadcast": "accelkit.ops",
    "broadcast_object_list": "accelkit.ops",
    "concatenate": "accelkit.ops",
    "copy_tensor_to_devices": "accelkit.ops",
    "gather": "accelkit.ops",
    "gather_object": "accelkit.ops",
    "pad_across_processes": "accelkit.ops",
    "recursively_apply": "accelkit.ops",
    "reduce": "accelkit.ops",
    "send_to_device": "accelkit.ops",
    "convert_outputs_to_fp32": "accelkit.precision",
    "get_grad_scaler": "accelkit.precision",
    "get_mixed_precision_context_manager": "accelkit.precision",
    "compile_regions": "accelkit.dynamo",
    "has_compiled_regions": "accelkit.dynamo",
    "CannotPadNestedTensorWarning": "accelkit.ops",
    "DistributedType": "accelkit.state",
    "PrecisionType": "accelkit.state",
    "FullyShardedDataParallelPlugin": "accelkit.fsdp",
    "ProjectConfiguration": "accelkit.checkpointing",
    "load_checkpoint_in_model": "accelkit.checkpointing",
    "DataLoaderConfiguration": "accelkit.data",
    "skip_first_batches": "accelkit.data",
    "RNGType": "accelkit.random",
    "set_seed": "accelkit.random",
    "synchronize_rng_state": "accelkit.random",
    "synchronize_rng_states": "accelkit.random",
    "clear_device_cache": "accelkit.utils.memory",
    "TensorInformation": "accelkit.utils.operations",
    "get_data_structure": "accelkit.utils.operations",
    "initialize_tensors": "accelkit.utils.operations",
    "is_tensor_information": "accelkit.utils.operations",
    "slice_tensors": "accelkit.utils.operations",
    "find_executable_batch_size": "accelkit.utils.memory",
    "release_memory": "accelkit.utils.memory",
    "should_reduce_batch_size": "accelkit.utils.memory",
    "write_basic_config": "accelkit.launch_config",
    "MODEL_NAME": _CONSTANTS,
    "OPTIMIZER_NAME": _CONSTANTS,
    "RNG_STATE_NAME": _CONSTANTS,
    "SAFE_MODEL_NAME": _CONSTANTS,
    "SAFE_WEIGHTS_INDEX_NAME": _CONSTANTS,
    "SAFE_WEIGHTS_NAME": _CONSTANTS,
    "SAFE_WEIGHTS_PATTERN_NAME": _CONSTANTS,
    "SAMPLER_NAME": _CONSTANTS,
    "SCALER_NAME": _CONSTANTS,
    "SCHEDULER_NAME": _CONSTANTS,
    "WEIGHTS_INDEX_NAME": _CONSTANTS,
    "WEIGHTS_NAME": _CONSTANTS,
    "WEIGHTS_PATTERN_NAME": _CONSTANTS,
    "compare_versions": _IMPORTS,
    "is_torch_version": _IMPORTS,
    "is_bf16_available": _IMPORTS,
    "is_bnb_available": _IMPORTS,
    "is_cuda_available": _IMPORTS,
    "is_fp16_available": _IMPORTS,
    "is_fp8_available": _IMPORTS,
    "is_habana_gaudi1": _IMPORTS,
    "is_hpu_available": _IMPORTS,
    "is_mlu_available": _IMPORTS,
    "is_mps_available": _IMPORTS,
    "is_musa_available": _IMPORTS,
    "is_neuron_available": _IMPORTS,
    "is_npu_available": _IMPORTS,
    "is_rocm_available": _IMPORTS,
    "is_sdaa_available": _IMPORTS,
    "is_torch_xla_available": _IMPORTS,
    "is_torchdata_stateful_dataloader_available": _IMPORTS,
    "is_tpu_available": _IMPORTS,
    "is_weights_only_available": _IMPORTS,
    "is_xccl_available": _IMPORTS,
    "is_xpu_available": _IMPORTS,
}
for _name in [
    "4bit_bnb",
    "8bit_bnb",
    "aim",
    "amdsmi",
    "bitsandbytes_multi_backend",
    "boto3",
    "clearml",
    "comet_ml",
    "datasets",
    "deepspeed",
    "dvclive",
    "import_timer",
    "lomo",
    "matplotlib",
    "megatron_lm",
    "mlflow",
    "msamp",
    "pandas",
    "peft",
    "pippy",
    "pynvml",
    "pytest",
    "rich",
    "sagemaker",
    "schedulefree",
    "swanlab",
    "tensorboard",
    "timm",
    "torchao",
    "torchdata",
    "torchvision",
    "trackio",
    "transformer_engine",
    "transformer_engine_mxfp8",
    "transformers",
    "triton",
    "wandb",
]:
    _PUBLIC[f"is_{_name}_available"] = _IMPORTS
for _name in [
    "convert_file_size_to_int",
    "is_peft_model",
    "model_has_dtensor",
    "tqdm",
    "clear_environment",
    "convert_bytes",
    "convert_to_fp32",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_device",
    "get_int_from_env",
    "get_pretty_name",
    "honor_type",
    "ignorant_find_batch_size",
    "is_compiled_module",
    "is_namedtuple",
    "is_port_in_use",
    "is_torch_tensor",
    "listify",
    "merge_dicts",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "recursive_getattr",
    "str_to_bool",
    "wait_for_everyone",
]:
    _PUBLIC[_name] = _OTHER

__all__ = sorted(_PUBLIC)
# Names of the reference accelkit refuses: importable, raising OutOfScopeError when used.
for _name in OUT_OF_SCOPE:
    _PUBLIC.setdefault(_name, "accelkit.out_of_scope")
__getattr__ = lazy_getattr(__name__, _PUBLIC)

if TYPE_CHECKING:  # the names of _PUBLIC, for type checkers (__all__ is built from _PUBLIC)
    # ruff: noqa: F401
    from accelkit.checkpointing import ProjectConfiguration, load_checkpoint_in_model
    from accelkit.data import DataLoaderConfiguration, skip_first_batches
    from accelkit.dynamo import DynamoBackend, TorchDynamoPlugin
    from accelkit.fsdp import FullyShardedDataParallelPlugin
    from accelkit.kwargs_handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
    )
    from accelkit.launch_config import write_basic_config
    from accelkit.ops import (
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
    from accelkit.optim import GradientAccumulationPlugin
    from accelkit.profiling import PROFILE_PATTERN_NAME, ProfileKwargs
    from accelkit.random import RNGType, set_seed, synchronize_rng_state, synchronize_rng_states
    from accelkit.state import DistributedType, PrecisionType
    from accelkit.trackers import GeneralTracker, LoggerType, register_tracker
    from accelkit.utils.constants import (
        MODEL_NAME,
        OPTIMIZER_NAME,
        RNG_STATE_NAME,
        SAFE_MODEL_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        SAFE_WEIGHTS_PATTERN_NAME,
        SAMPLER_NAME,
        SCALER_NAME,
        SCHEDULER_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
        WEIGHTS_PATTERN_NAME,
    )
    from accelkit.utils.memory import (
        clear_device_cache,
        find_executable_batch_size,
        release_memory,
        should_reduce_batch_size,
    )
