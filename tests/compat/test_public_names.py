"""Every in-scope public name of the installed Accelerate exists in accelkit, bindable the same way.

The lists are generated from the installed ``accelerate`` (``accelerate/__init__.py``,
``accelerate.utils``, the ``Accelerator`` class and the state classes), so a new Accelerate
release shows its new names here as failures: port them, or add them to ``OUT_OF_SCOPE`` with
the reason. Signatures are compared with :func:`incompatibilities` (positional order, names,
``*args``/``**kwargs``, nothing extra required). Differences owned by other areas, or kept on
purpose, are strict xfails with their reason in ``KNOWN_DIFFERENCES``.
"""

from __future__ import annotations

import enum
import inspect
import types
from typing import Any

import pytest

import accelkit
import accelkit.state
import accelkit.utils
from tests.compat._signatures import incompatibilities

accelerate = pytest.importorskip("accelerate", reason="accelerate (a dev dependency) is missing")
reference_state = pytest.importorskip("accelerate.state")
reference_utils = pytest.importorskip("accelerate.utils")

_DEEPSPEED = "DeepSpeed is out of scope (DESIGN.md, compatibility contract)"
_MEGATRON = "Megatron-LM is out of scope"
_FP8 = "FP8 training (Transformer Engine, MS-AMP, torchao) is out of scope"
_XLA = "TPU/XLA execution is out of scope"
_BIG_MODEL = "big-model inference / offload / quantized loading is out of scope"
_PARALLELISM = "tensor / context / pipeline parallelism (ParallelismConfig) is out of scope"
_FSDP_INTERNALS = (
    "the reference's FSDP helpers; accelkit's FSDP2 is driven by Accelerator.prepare and "
    "save_state/load_state (accelkit.fsdp), with no separate helper API"
)
_LAUNCH_INTERNALS = (
    "the reference launcher's internals (environment assembly, SageMaker, cluster probes); "
    "`accelkit launch` builds on torch.distributed.run instead"
)
_PICKLE = (
    "pickle-based save/load of arbitrary objects: the threat model forbids an unrestricted "
    "unpickler; use Accelerator.save_model / save_state"
)
_INTERNALS = "an implementation detail of the reference's Accelerator, not a training helper"
_OTHER_DEVICES = "profiling constants of devices accelkit does not drive (XPU, MTIA)"
_LOMO = "LOMO optimizers (lomo_optim) are not supported"

# name -> why accelkit deliberately does not provide it. Grouped by reason.
OUT_OF_SCOPE: dict[str, str] = {
    # DeepSpeed
    **dict.fromkeys(
        [
            "DeepSpeedPlugin",
            "DeepSpeedSequenceParallelConfig",
            "GatheredParameters",
            "deepspeed_required",
            "compile_regions_deepspeed",
            "prepare_deepspeed_cmd_env",
            "get_deepspeed_plugin",
            "select_deepspeed_plugin",
            "deepspeed_ulysses_dl_adapter",
        ],
        _DEEPSPEED,
    ),
    # Megatron-LM
    **dict.fromkeys(
        [
            "AbstractTrainStep",
            "BertTrainStep",
            "GPTTrainStep",
            "T5TrainStep",
            "MegatronLMDummyDataLoader",
            "MegatronLMDummyScheduler",
            "MegatronLMPlugin",
            "add_model_config_to_megatron_parser",
            "avg_losses_across_data_parallel_group",
        ],
        _MEGATRON,
    ),
    # FP8
    **dict.fromkeys(
        [
            "AORecipeKwargs",
            "FP8RecipeKwargs",
            "MSAMPRecipeKwargs",
            "TERecipeKwargs",
            "CustomDtype",
            "apply_fp8_autowrap",
            "check_cuda_fp8_capability",
            "contextual_fp8_autocast",
            "convert_model",
            "convert_model_to_fp8_ao",
            "filter_first_and_last_linear_layers",
            "has_ao_layers",
            "has_transformer_engine_layers",
            "torchao_required",
        ],
        _FP8,
    ),
    # TPU / XLA
    **dict.fromkeys(["install_xla", "prepare_tpu"], _XLA),
    # Big-model inference, offload, quantization
    **dict.fromkeys(
        [
            "cpu_offload",
            "cpu_offload_with_hook",
            "disk_offload",
            "dispatch_model",
            "infer_auto_device_map",
            "init_empty_weights",
            "init_on_device",
            "load_checkpoint_and_dispatch",
            "prepare_pippy",
            "pad_input_tensors",
            "BnbQuantizationConfig",
            "OffloadedWeightsLoader",
            "PrefixedDataset",
            "align_module_device",
            "calculate_maximum_sizes",
            "check_device_map",
            "check_tied_parameters_in_config",
            "check_tied_parameters_on_same_device",
            "compute_module_sizes",
            "dtype_byte_size",
            "ensure_weights_retied",
            "extract_submodules_state_dict",
            "find_tied_parameters",
            "get_balanced_memory",
            "get_max_layer_size",
            "get_max_memory",
            "has_4bit_bnb_layers",
            "has_offloaded_params",
            "load_and_quantize_model",
            "load_offloaded_weight",
            "load_offloaded_weights",
            "load_state_dict",
            "named_module_tensors",
            "offload_state_dict",
            "offload_weight",
            "retie_parameters",
            "save_offload_index",
            "set_module_tensor_to_device",
            "verify_device_map",
        ],
        _BIG_MODEL,
    ),
    # Tensor / context / pipeline parallelism
    **dict.fromkeys(
        [
            "ParallelismConfig",
            "TorchContextParallelConfig",
            "TorchTensorParallelConfig",
            "TorchTensorParallelPlugin",
            "get_model_tp_size",
            "context_parallel_rank",
            "data_parallel_rank",
            "data_parallel_shard_rank",
            "pipeline_parallel_rank",
            "tensor_parallel_rank",
            "is_composable_parallelism_enabled",
            "maybe_context_parallel",
        ],
        _PARALLELISM,
    ),
    # The reference's FSDP helper functions
    **dict.fromkeys(
        [
            "fsdp2_apply_ac",
            "fsdp2_canonicalize_names",
            "fsdp2_load_full_state_dict",
            "fsdp2_prepare_model",
            "fsdp2_switch_optimizer_parameters",
            "get_fsdp2_grad_scaler",
            "load_fsdp_model",
            "load_fsdp_optimizer",
            "save_fsdp_model",
            "save_fsdp_optimizer",
            "merge_fsdp_weights",
            "enable_fsdp_ram_efficient_loading",
            "disable_fsdp_ram_efficient_loading",
            "compile_regions_fsdp2",
        ],
        _FSDP_INTERNALS,
    ),
    # The reference launcher's internals
    **dict.fromkeys(
        [
            "ComputeEnvironment",
            "SageMakerDistributedType",
            "PrepareForLaunch",
            "TORCH_LAUNCH_PARAMS",
            "prepare_multi_gpu_env",
            "prepare_sagemager_args_inputs",
            "prepare_simple_launcher_cmd_env",
            "convert_dict_to_env_variables",
            "purge_accelerate_environment",
            "check_cuda_p2p_ib_support",
            "check_os_kernel",
            "get_cpu_distributed_information",
            "set_numa_affinity",
            "get_gpu_info",
            "are_libraries_initialized",
        ],
        _LAUNCH_INTERNALS,
    ),
    **dict.fromkeys(["save", "load"], _PICKLE),
    **dict.fromkeys(
        [
            "TORCH_DISTRIBUTED_OPERATION_TYPES",
            "get_current_device_type",
            "get_module_children_bottom_up",
            "id_tensor_storage",
            "clean_state_dict_for_safetensors",
        ],
        _INTERNALS,
    ),
    **dict.fromkeys(
        ["MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION"],
        _OTHER_DEVICES,
    ),
    "lomo_backward": _LOMO,
}

_CHECKPOINT_NAMES = (
    "checkpointing: the reference's checkpoint file-name constants; accelkit's layout "
    "(accelkit/checkpointing/layout.py) should export the ones it shares (model.safetensors, "
    "the index) under these names"
)
_DATA = (
    "data loading: DataLoaderConfiguration's fields are not in the reference's order "
    "(split_batches, dispatch_batches, even_batches, use_seedable_sampler, data_seed, "
    "non_blocking, use_stateful_dataloader), so positional construction differs"
)
_FSDP1 = (
    "FSDP: accelkit's plugin is FSDP2-only (fully_shard); the reference's FSDP1 options "
    "(sharding_strategy, backward_prefetch, use_orig_params, limit_all_gathers, ...) and its "
    "parameter order are absent"
)
_LOAD_CHECKPOINT = (
    "checkpointing (accelkit/checkpointing/model_io.py): load_checkpoint_in_model lacks the "
    "reference's parameters after device_map (offload_folder, dtype, offload_state_dict, "
    "offload_buffers, keep_in_fp32_modules, offload_8bit_bnb, full_state_dict, "
    "broadcast_from_rank0; the offload ones are out of scope and should be refused by name) and "
    "its parameter order; the reference's default is strict=False"
)
_NOTEBOOK = (
    "launcher (accelkit/launch.py): notebook_launcher lacks node_rank, num_nodes, rdzv_backend, "
    "rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval, "
    "log_line_prefix_template (and takes cpu/start_method in their positions)"
)
_TRACKERS = "trackers: LoggerType lacks AIM, CLEARML, DVCLIVE, SWANLAB, TRACKIO (accelkit/trackers)"

# (where, name) -> why it differs today; each is a strict xfail, so fixing it flips the test.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    **{
        ("accelerate.utils", name): _CHECKPOINT_NAMES
        for name in (
            "MODEL_NAME",
            "OPTIMIZER_NAME",
            "RNG_STATE_NAME",
            "SAFE_MODEL_NAME",
            "SAFE_WEIGHTS_INDEX_NAME",
            "SAFE_WEIGHTS_NAME",
            "SAFE_WEIGHTS_PATTERN_NAME",
            "SAMPLER_NAME",
            "SCALER_NAME",
            "SCHEDULER_NAME",
            "WEIGHTS_INDEX_NAME",
            "WEIGHTS_NAME",
            "WEIGHTS_PATTERN_NAME",
        )
    },
    ("accelerate.utils", "write_basic_config"): (
        "launcher: write_basic_config (writing the default launch config file) belongs to the "
        "launch config work"
    ),
    ("accelerate", "DataLoaderConfiguration"): _DATA,
    ("accelerate.utils", "DataLoaderConfiguration"): _DATA,
    ("accelerate", "FullyShardedDataParallelPlugin"): _FSDP1,
    ("accelerate.utils", "FullyShardedDataParallelPlugin"): _FSDP1,
    ("accelerate", "load_checkpoint_in_model"): _LOAD_CHECKPOINT,
    ("accelerate.utils", "load_checkpoint_in_model"): _LOAD_CHECKPOINT,
    ("accelerate", "notebook_launcher"): _NOTEBOOK,
    ("accelerate.utils", "LoggerType"): _TRACKERS,
}


def _public(module: types.ModuleType) -> list[str]:
    return sorted(
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    )


def _members(cls: type) -> list[str]:
    return sorted(name for name, _ in inspect.getmembers(cls) if not name.startswith("_"))


def _is_enum(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, enum.Enum)


def _problems(theirs: Any, ours: Any) -> list[str]:
    if _is_enum(theirs):
        if not _is_enum(ours):
            return ["not an enum"]
        missing = sorted(set(theirs.__members__) - set(ours.__members__))
        return [f"missing members {missing}"] if missing else []
    if inspect.isclass(theirs) or inspect.isroutine(theirs):
        if not callable(ours):
            return ["not callable"]
        return incompatibilities(theirs, ours)
    if isinstance(theirs, (str, int, float, bool, tuple)) and theirs != ours:
        return [f"value {ours!r}, the reference's is {theirs!r}"]
    return []


_OURS = {"accelerate": accelkit, "accelerate.utils": accelkit.utils}
_THEIRS = {"accelerate": accelerate, "accelerate.utils": reference_utils}


def _cases() -> list[Any]:
    cases = []
    for where, module in _THEIRS.items():
        for name in _public(module):
            if name in OUT_OF_SCOPE:
                continue
            marks = []
            if (where, name) in KNOWN_DIFFERENCES:
                marks.append(pytest.mark.xfail(reason=KNOWN_DIFFERENCES[where, name], strict=True))
            cases.append(pytest.param(where, name, marks=marks, id=f"{where}.{name}"))
    return cases


@pytest.mark.parametrize(("where", "name"), _cases())
def test_public_name_exists_and_binds_the_same_way(where: str, name: str) -> None:
    theirs = getattr(_THEIRS[where], name)
    assert hasattr(_OURS[where], name), f"{where}.{name} has no accelkit counterpart"
    assert _problems(theirs, getattr(_OURS[where], name)) == []


_CLASS_PAIRS = {
    "Accelerator": (accelerate.Accelerator, accelkit.Accelerator),
    "PartialState": (reference_state.PartialState, accelkit.state.PartialState),
    "AcceleratorState": (reference_state.AcceleratorState, accelkit.state.AcceleratorState),
    "GradientState": (reference_state.GradientState, accelkit.state.GradientState),
}


@pytest.fixture(scope="module")
def instances() -> dict[str, Any]:
    """One accelkit object of each class, for members that are instance attributes."""
    accelkit.state.AcceleratorState._reset_state()
    accelerator = accelkit.Accelerator(cpu=True)
    return {
        "Accelerator": accelerator,
        "PartialState": accelkit.state.PartialState(cpu=True),
        "AcceleratorState": accelerator.state,
        "GradientState": accelerator.gradient_state,
    }


def _member_cases() -> list[Any]:
    return [
        pytest.param(cls, name, id=f"{cls}.{name}")
        for cls, (theirs, _) in _CLASS_PAIRS.items()
        for name in _members(theirs)
        if name not in OUT_OF_SCOPE
    ]


@pytest.mark.parametrize(("cls", "name"), _member_cases())
def test_class_member_exists_and_binds_the_same_way(
    cls: str, name: str, instances: dict[str, Any]
) -> None:
    theirs_cls, ours_cls = _CLASS_PAIRS[cls]
    assert hasattr(instances[cls], name), f"{cls}.{name} has no accelkit counterpart"
    theirs = inspect.getattr_static(theirs_cls, name)
    ours = inspect.getattr_static(ours_cls, name, None)
    if inspect.isfunction(theirs) and ours is not None:
        assert inspect.isfunction(ours), f"{cls}.{name} is a method in the reference"
        assert incompatibilities(theirs, ours) == []


@pytest.mark.parametrize("name", sorted(OUT_OF_SCOPE))
def test_out_of_scope_names_still_exist_in_the_reference(name: str) -> None:
    """A name dropped by the reference leaves this list, so it never hides a new one."""
    found = any(hasattr(module, name) for module in _THEIRS.values()) or any(
        hasattr(theirs, name) for theirs, _ in _CLASS_PAIRS.values()
    )
    assert found, f"{name} is no longer in accelerate: remove it from OUT_OF_SCOPE"
