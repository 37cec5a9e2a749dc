"""Names of the reference that accelkit deliberately does not implement, importable so that a
script which only imports them still runs, and refusing clearly when used.

``from accelkit import DeepSpeedPlugin`` works; ``DeepSpeedPlugin(...)`` (or calling
``init_empty_weights()``, ...) raises :class:`OutOfScopeError` naming the feature and why. The
table below is the single list of these names, grouped by reason;
``tests/compat/test_public_names.py`` checks it against the installed reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from accelkit.errors import AccelkitError

__all__ = ["OUT_OF_SCOPE", "OutOfScopeError", "refusal"]

_DEEPSPEED = "DeepSpeed is not supported by accelkit; use FSDP (FullyShardedDataParallelPlugin)"
_MEGATRON = "Megatron-LM is not supported by accelkit"
_FP8 = "FP8 training (Transformer Engine, MS-AMP, torchao) is not supported by accelkit"
_XLA = "TPU/XLA execution is not supported by accelkit"
_BIG_MODEL = (
    "big-model inference / offload / quantized loading is not supported by accelkit; load "
    "models with load_checkpoint_in_model, or use accelerate for inference"
)
_PARALLELISM = (
    "tensor / context / pipeline parallelism (ParallelismConfig) is not supported by accelkit; "
    "use FSDP"
)
_FSDP_HELPERS = (
    "the reference's FSDP helper functions are not part of accelkit: FSDP2 is driven by "
    "Accelerator.prepare and save_state/load_state"
)
_LAUNCHER = (
    "the reference launcher's internals are not part of accelkit: `accelkit launch` builds on "
    "torch.distributed.run"
)
_PICKLE = (
    "pickle-based save/load of arbitrary objects is not offered (a checkpoint must never be able "
    "to run code); use Accelerator.save_model / save_state / load_state"
)
_INTERNAL = "an implementation detail of the reference, not part of accelkit's API"

# name -> why it is refused. Every entry is importable from accelkit.utils (and from accelkit
# where the reference exports it at the top level; accelerate.utils.modeling's from
# accelkit.utils.modeling). Names a later Accelerate dropped stay, marked "removed in", for the
# scripts written for the older one (tests/compat/test_public_names.py lists them as REMOVED).
OUT_OF_SCOPE: dict[str, str] = {
    # DeepSpeed
    "DeepSpeedPlugin": _DEEPSPEED,
    "DeepSpeedSequenceParallelConfig": _DEEPSPEED,
    "GatheredParameters": _DEEPSPEED,
    "deepspeed_required": _DEEPSPEED,
    "compile_regions_deepspeed": _DEEPSPEED,
    "prepare_deepspeed_cmd_env": _DEEPSPEED,
    # Megatron-LM
    "AbstractTrainStep": _MEGATRON,
    "BertTrainStep": _MEGATRON,
    "GPTTrainStep": _MEGATRON,
    "T5TrainStep": _MEGATRON,
    "MegatronLMDummyDataLoader": _MEGATRON,
    "MegatronLMDummyScheduler": _MEGATRON,
    "MegatronLMPlugin": _MEGATRON,
    "add_model_config_to_megatron_parser": _MEGATRON,
    "avg_losses_across_data_parallel_group": _MEGATRON,
    # FP8
    "AORecipeKwargs": _FP8,
    "FP8RecipeKwargs": _FP8,  # removed in Accelerate 1.16
    "MSAMPRecipeKwargs": _FP8,  # removed in Accelerate 1.16
    "TERecipeKwargs": _FP8,
    "CustomDtype": _FP8,
    "apply_fp8_autowrap": _FP8,
    "check_cuda_fp8_capability": _FP8,
    "contextual_fp8_autocast": _FP8,
    "convert_model": _FP8,
    "convert_model_to_fp8_ao": _FP8,
    "filter_first_and_last_linear_layers": _FP8,
    "has_ao_layers": _FP8,
    "has_transformer_engine_layers": _FP8,
    "torchao_required": _FP8,
    # TPU / XLA
    "install_xla": _XLA,
    "prepare_tpu": _XLA,
    # Big-model inference, offload, quantization, pipeline inference
    "cpu_offload": _BIG_MODEL,
    "cpu_offload_with_hook": _BIG_MODEL,
    "disk_offload": _BIG_MODEL,
    "dispatch_model": _BIG_MODEL,
    "infer_auto_device_map": _BIG_MODEL,
    "init_empty_weights": _BIG_MODEL,
    "init_on_device": _BIG_MODEL,
    "load_checkpoint_and_dispatch": _BIG_MODEL,
    "prepare_pippy": _BIG_MODEL,  # removed in Accelerate 1.16
    "pad_input_tensors": _BIG_MODEL,
    "BnbQuantizationConfig": _BIG_MODEL,
    "OffloadedWeightsLoader": _BIG_MODEL,
    "PrefixedDataset": _BIG_MODEL,
    "align_module_device": _BIG_MODEL,
    "calculate_maximum_sizes": _BIG_MODEL,
    "check_device_map": _BIG_MODEL,
    "check_tied_parameters_in_config": _BIG_MODEL,
    "check_tied_parameters_on_same_device": _BIG_MODEL,
    "compute_module_sizes": _BIG_MODEL,
    "dtype_byte_size": _BIG_MODEL,
    "ensure_weights_retied": _BIG_MODEL,
    "extract_submodules_state_dict": _BIG_MODEL,
    "find_tied_parameters": _BIG_MODEL,
    "get_balanced_memory": _BIG_MODEL,
    "get_max_layer_size": _BIG_MODEL,
    "get_max_memory": _BIG_MODEL,
    "has_4bit_bnb_layers": _BIG_MODEL,
    "has_offloaded_params": _BIG_MODEL,
    "load_and_quantize_model": _BIG_MODEL,
    "load_offloaded_weight": _BIG_MODEL,
    "load_offloaded_weights": _BIG_MODEL,
    "load_state_dict": _BIG_MODEL,
    "named_module_tensors": _BIG_MODEL,
    "offload_state_dict": _BIG_MODEL,
    "offload_weight": _BIG_MODEL,
    "retie_parameters": _BIG_MODEL,
    "save_offload_index": _BIG_MODEL,
    "set_module_tensor_to_device": _BIG_MODEL,
    # ... and the rest of accelerate.utils.modeling (importable from accelkit.utils.modeling)
    "check_device_same": _BIG_MODEL,
    "clean_device_map": _BIG_MODEL,
    "compute_module_total_buffer_size": _BIG_MODEL,
    "fallback_allocate": _BIG_MODEL,
    "get_accelerator_free_memory": _BIG_MODEL,
    "get_module_leaves": _BIG_MODEL,
    "get_module_size_with_ties": _BIG_MODEL,
    "get_non_persistent_buffers": _BIG_MODEL,
    "get_state_dict_from_offload": _BIG_MODEL,
    "get_state_dict_offloaded_model": _BIG_MODEL,
    "normalize_device": _BIG_MODEL,
    # Tensor / context / pipeline parallelism
    "ParallelismConfig": _PARALLELISM,
    "TorchContextParallelConfig": _PARALLELISM,
    "TorchTensorParallelConfig": _PARALLELISM,
    "TorchTensorParallelPlugin": _PARALLELISM,
    "get_model_tp_size": _PARALLELISM,
    # The reference's FSDP helper functions
    "fsdp2_apply_ac": _FSDP_HELPERS,
    "fsdp2_canonicalize_names": _FSDP_HELPERS,
    "fsdp2_load_full_state_dict": _FSDP_HELPERS,
    "fsdp2_prepare_model": _FSDP_HELPERS,
    "fsdp2_switch_optimizer_parameters": _FSDP_HELPERS,
    "get_fsdp2_grad_scaler": _FSDP_HELPERS,
    "load_fsdp_model": _FSDP_HELPERS,
    "load_fsdp_optimizer": _FSDP_HELPERS,
    "save_fsdp_model": _FSDP_HELPERS,
    "save_fsdp_optimizer": _FSDP_HELPERS,
    "merge_fsdp_weights": _FSDP_HELPERS,
    "enable_fsdp_ram_efficient_loading": _FSDP_HELPERS,
    "disable_fsdp_ram_efficient_loading": _FSDP_HELPERS,
    "compile_regions_fsdp2": _FSDP_HELPERS,
    # The reference launcher's internals
    "ComputeEnvironment": _LAUNCHER,
    "SageMakerDistributedType": _LAUNCHER,
    "PrepareForLaunch": _LAUNCHER,
    "prepare_multi_gpu_env": _LAUNCHER,
    "prepare_sagemager_args_inputs": _LAUNCHER,
    "prepare_simple_launcher_cmd_env": _LAUNCHER,
    "convert_dict_to_env_variables": _LAUNCHER,
    "purge_accelerate_environment": _LAUNCHER,
    "check_cuda_p2p_ib_support": _LAUNCHER,
    "check_os_kernel": _LAUNCHER,
    "get_cpu_distributed_information": _LAUNCHER,
    "set_numa_affinity": _LAUNCHER,
    "get_gpu_info": _LAUNCHER,
    "are_libraries_initialized": _LAUNCHER,
    # Unrestricted pickles
    "save": _PICKLE,
    "load": _PICKLE,
    # The reference's internals
    "get_current_device_type": _INTERNAL,
    "get_module_children_bottom_up": _INTERNAL,
    "id_tensor_storage": _INTERNAL,
    "clean_state_dict_for_safetensors": _INTERNAL,
}


class OutOfScopeError(AccelkitError, NotImplementedError):
    """A feature of the reference that accelkit deliberately does not provide."""


def _raise(name: str) -> NoReturn:
    raise OutOfScopeError(f"{name}: {OUT_OF_SCOPE[name]}.")


def refusal(name: str) -> Any:
    """An importable stand-in for ``name`` that raises :class:`OutOfScopeError` when used.

    Class names (``DeepSpeedPlugin``) become classes that refuse to be instantiated, so that
    ``isinstance`` checks still work; other names become functions that refuse to be called.

    Raises:
        KeyError: if ``name`` is not in :data:`OUT_OF_SCOPE`.
    """
    reason = OUT_OF_SCOPE[name]
    doc = f"Not provided by accelkit: {reason}."
    if name[:1].isupper():

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _raise(name)

        return type(name, (), {"__init__": __init__, "__doc__": doc, "__module__": __name__})

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _raise(name)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = doc
    return refuse


def __getattr__(name: str) -> Callable[..., Any] | type:
    if name in OUT_OF_SCOPE:
        value = refusal(name)
        globals()[name] = value  # one object per name, so isinstance checks are stable
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
