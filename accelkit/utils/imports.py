"""``is_*_available`` probes scripts written for the reference call.

Package probes look the package up without importing it. Device probes answer "can accelkit
run this process on that device": accelkit drives the CPU and CUDA (and reports MPS), so the
probes of devices it does not drive (XPU, NPU, MLU, HPU, MUSA, SDAA, Neuron, XLA/TPU) return
False, and a script's ``if is_xpu_available():`` branch is skipped as on a machine without one.
Probes of out-of-scope engines (DeepSpeed, Megatron-LM, FP8 libraries) report whether the package
is installed, as in the reference; accelkit still refuses to use them.
"""

from __future__ import annotations

import functools
import importlib.util
import operator

import torch
from packaging import version as _version

from accelkit.errors import ConfigurationError

__all__ = [
    "is_bf16_available",
    "is_cuda_available",
    "is_fp16_available",
    "is_mps_available",
    "is_package_available",
    "is_rocm_available",
    "is_torch_version",
]

_OPERATIONS = {
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    ">": operator.gt,
}


@functools.cache
def is_package_available(name: str) -> bool:
    """Whether the top-level package ``name`` can be imported (it is not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def compare_versions(
    library_or_version: str | _version.Version, operation: str, requirement_version: str
) -> bool:
    """Compare a library's installed version (or a version) with ``requirement_version``.

    Args:
        library_or_version: a distribution name (``"torch"``) or a version.
        operation: one of ``<``, ``<=``, ``==``, ``!=``, ``>=``, ``>``.
        requirement_version: the version to compare with.

    Raises:
        ValueError: for an unknown ``operation``.
    """
    if operation not in _OPERATIONS:
        raise ConfigurationError(
            f"Unknown operation {operation!r}; expected one of {list(_OPERATIONS)}."
        )
    if isinstance(library_or_version, str):
        from importlib.metadata import version as installed

        library_or_version = _version.parse(installed(library_or_version))
    return bool(_OPERATIONS[operation](library_or_version, _version.parse(requirement_version)))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version, e.g. ``is_torch_version(">=", "2.3")``."""
    return compare_versions(_version.parse(torch.__version__), operation, version)


def is_cuda_available() -> bool:
    """Whether CUDA can be used."""
    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Whether the CUDA device is an AMD GPU under ROCm."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS backend is available."""
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bfloat16 mixed precision works here (the CPU always; CUDA when supported)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Whether float16 mixed precision works here (CPU autocast and CUDA both do)."""
    return True


def is_fp8_available() -> bool:
    """Always False: FP8 training is out of accelkit's scope."""
    return False


def is_xpu_available(check_device: bool = False) -> bool:
    """False: accelkit does not drive Intel XPUs."""
    return False


def is_npu_available(check_device: bool = False) -> bool:
    """False: accelkit does not drive Ascend NPUs."""
    return False


def is_mlu_available(check_device: bool = False) -> bool:
    """False: accelkit does not drive Cambricon MLUs."""
    return False


def is_musa_available(check_device: bool = False) -> bool:
    """False: accelkit does not drive Moore Threads MUSA devices."""
    return False


def is_sdaa_available(check_device: bool = False) -> bool:
    """False: accelkit does not drive SDAA devices."""
    return False


def is_neuron_available(check_device: bool = False) -> bool:
    """False: accelkit does not drive AWS Neuron devices."""
    return False


def is_hpu_available(init_hccl: bool = False) -> bool:
    """False: accelkit does not drive Habana Gaudi HPUs."""
    return False


def is_habana_gaudi1() -> bool:
    """False: accelkit does not drive Habana Gaudi HPUs."""
    return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """False: XLA/TPU execution is out of accelkit's scope."""
    return False


def is_tpu_available(check_device: bool = True) -> bool:
    """False: TPU execution is out of accelkit's scope (an older reference name)."""
    return False


def is_xccl_available() -> bool:
    """False: the XCCL backend belongs to Intel XPUs, which accelkit does not drive."""
    return False


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` is available (always, on supported torch)."""
    return is_torch_version(">=", "2.4.0")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata's ``StatefulDataLoader`` can be imported."""
    if not is_package_available("torchdata"):
        return False
    return importlib.util.find_spec("torchdata.stateful_dataloader") is not None


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes is installed (at ``min_version`` or newer, when given)."""
    if not is_package_available("bitsandbytes"):
        return False
    return min_version is None or compare_versions("bitsandbytes", ">=", min_version)


class _PackageProbe:
    """``is_<package>_available()``: whether a package is installed (it is not imported)."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.__doc__ = f"Whether the {package!r} package is installed."

    def __call__(self) -> bool:
        return is_package_available(self.package)


# Probes whose answer is "is this package installed", as in the reference.
is_4bit_bnb_available = _PackageProbe("bitsandbytes")
is_8bit_bnb_available = _PackageProbe("bitsandbytes")
is_aim_available = _PackageProbe("aim")
is_amdsmi_available = _PackageProbe("amdsmi")
is_bitsandbytes_multi_backend_available = _PackageProbe("bitsandbytes")
is_boto3_available = _PackageProbe("boto3")
is_clearml_available = _PackageProbe("clearml")
is_comet_ml_available = _PackageProbe("comet_ml")
is_datasets_available = _PackageProbe("datasets")
is_deepspeed_available = _PackageProbe("deepspeed")
is_dvclive_available = _PackageProbe("dvclive")
is_import_timer_available = _PackageProbe("import_timer")
is_lomo_available = _PackageProbe("lomo_optim")
is_matplotlib_available = _PackageProbe("matplotlib")
is_megatron_lm_available = _PackageProbe("megatron")
is_mlflow_available = _PackageProbe("mlflow")
is_msamp_available = _PackageProbe("msamp")
is_pandas_available = _PackageProbe("pandas")
is_peft_available = _PackageProbe("peft")
is_pippy_available = _PackageProbe("pippy")
is_pynvml_available = _PackageProbe("pynvml")
is_pytest_available = _PackageProbe("pytest")
is_rich_available = _PackageProbe("rich")
is_sagemaker_available = _PackageProbe("sagemaker")
is_schedulefree_available = _PackageProbe("schedulefree")
is_swanlab_available = _PackageProbe("swanlab")
is_tensorboard_available = _PackageProbe("tensorboard")
is_timm_available = _PackageProbe("timm")
is_torchao_available = _PackageProbe("torchao")
is_torchdata_available = _PackageProbe("torchdata")
is_torchvision_available = _PackageProbe("torchvision")
is_trackio_available = _PackageProbe("trackio")
is_transformer_engine_available = _PackageProbe("transformer_engine")
is_transformer_engine_mxfp8_available = _PackageProbe("transformer_engine")
is_transformers_available = _PackageProbe("transformers")
is_triton_available = _PackageProbe("triton")
is_wandb_available = _PackageProbe("wandb")

__all__ += [
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bitsandbytes_multi_backend_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_msamp_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "compare_versions",
    "is_bnb_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_torch_xla_available",
    "is_torchdata_stateful_dataloader_available",
    "is_tpu_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
]
