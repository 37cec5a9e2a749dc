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
    "AutocastKwargs": "accelkit.training.kwargs_handlers",
    "DDPCommunicationHookType": "accelkit.training.kwargs_handlers",
    "DistributedDataParallelKwargs": "accelkit.training.kwargs_handlers",
    "GradScalerKwargs": "accelkit.training.kwargs_handlers",
    "InitProcessGroupKwargs": "accelkit.training.kwargs_handlers",
    "KwargsHandler": "accelkit.training.kwargs_handlers",
    "ProfileKwargs": "accelkit.training.profiling",
    "PROFILE_PATTERN_NAME": "accelkit.training.profiling",
    "DynamoBackend": "accelkit.training.dynamo",
    "TorchDynamoPlugin": "accelkit.training.dynamo",
    "GradientAccumulationPlugin": "accelkit.training.optim",
    "DistributedOperationException": "accelkit.runtime.ops",
    "broadcast": "accelkit.runtime.ops",
    "broadcast_object_list": "accelkit.runtime.ops",
    "concatenate": "accelkit.runtime.ops",
    "copy_tensor_to_devices": "accelkit.runtime.ops",
    "gather": "accelkit.runtime.ops",
    "gather_object": "accelkit.runtime.ops",
    "pad_across_processes": "accelkit.runtime.ops",
    "recursively_apply": "accelkit.runtime.ops",
    "reduce": "accelkit.runtime.ops",
    "send_to_device": "accelkit.runtime.ops",
    "convert_outputs_to_fp32": "accelkit.training.precision",
    "get_grad_scaler": "accelkit.training.precision",
    "get_mixed_precision_context_manager": "accelkit.training.precision",
    "compile_regions": "accelkit.training.dynamo",
    "has_compiled_regions": "accelkit.training.dynamo",
    "CannotPadNestedTensorWarning": "accelkit.runtime.ops",
    "DistributedType": "accelkit.runtime.state",
    "get_distributed_backend": "accelkit.runtime.state",
    "get_torch_accelerator_backend": "accelkit.runtime.state",
    "PrecisionType": "accelkit.runtime.state",
    "FullyShardedDataParallelPlugin": "accelkit.fsdp.runtime",
    "ProjectConfiguration": "accelkit.checkpointing",
    "load_checkpoint_in_model": "accelkit.checkpointing",
    "DataLoaderConfiguration": "accelkit.data.preparation",
    "skip_first_batches": "accelkit.data.preparation",
    "RNGType": "accelkit.runtime.random",
    "set_seed": "accelkit.runtime.random",
    "synchronize_rng_state": "accelkit.runtime.random",
    "synchronize_rng_states": "accelkit.runtime.random",
    "clear_device_cache": "accelkit.utils.memory",
    "TensorInformation": "accelkit.utils.operations",
    "get_data_structure": "accelkit.utils.operations",
    "initialize_tensors": "accelkit.utils.operations",
    "is_tensor_information": "accelkit.utils.operations",
    "slice_tensors": "accelkit.utils.operations",
    "find_executable_batch_size": "accelkit.utils.memory",
    "release_memory": "accelkit.utils.memory",
    "should_reduce_batch_size": "accelkit.utils.memory",
    "write_basic_config": "accelkit.launch.config",
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
    from accelkit.data.preparation import DataLoaderConfiguration, skip_first_batches
    from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin
    from accelkit.launch.config import write_basic_config
    from accelkit.runtime.ops import (
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
    from accelkit.runtime.random import (
        RNGType,
        set_seed,
        synchronize_rng_state,
        synchronize_rng_states,
    )
    from accelkit.runtime.state import (
        DistributedType,
        PrecisionType,
        get_distributed_backend,
        get_torch_accelerator_backend,
    )
    from accelkit.trackers import GeneralTracker, LoggerType, register_tracker
    from accelkit.training.dynamo import DynamoBackend, TorchDynamoPlugin
    from accelkit.training.kwargs_handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
    )
    from accelkit.training.optim import GradientAccumulationPlugin
    from accelkit.training.profiling import PROFILE_PATTERN_NAME, ProfileKwargs
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
