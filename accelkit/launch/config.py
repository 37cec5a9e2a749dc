"""Config files of ``accelerate config``, read by ``accelkit launch`` and written by
``accelkit config``.

The file is YAML (JSON is YAML too, which is what ``accelerate config default`` writes). Its
default place is the reference tool's: ``$HF_HOME/accelerate/default_config.yaml``, with
``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface`` and that to ``~/.cache/huggingface``.
As in the reference, ``--config_file`` is always read and the default file is read unless
``--cpu`` is given; a flag on the command line wins over the file.

Keys map to launch flags (``use_cpu`` -> ``--cpu``; ``fsdp_config``, ``dynamo_config`` entries ->
``--fsdp_*``, ``--dynamo_*``); ``distributed_type`` picks ``--multi_gpu`` or ``--use_fsdp``.
A key for a refused feature is refused with its reason unless its value asks for nothing, as the
``tpu_use_cluster: false`` in every default file does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from accelkit.launch.flags import Setting, refusal_for
from accelkit.runtime.environment import parse_mixed_precision

__all__ = [
    "default_config_path",
    "default_settings",
    "read_config_file",
    "write_basic_config",
    "write_config_file",
]

# Top-level keys that map to a flag of another name; the other top-level keys are flag names.
_RENAMED = {"use_cpu": "cpu"}
# Keys of the reference's ClusterConfig that are not flags, handled here.
_STRUCTURE = {"compute_environment", "distributed_type"}
_SECTIONS = {  # nested sections: their keys become flags with this prefix
    "fsdp_config": "fsdp_",
    "dynamo_config": "dynamo_",
    "fp8_config": "fp8_",
    "deepspeed_config": "deepspeed_",
    "megatron_lm_config": "megatron_lm_",
    "parallelism_config": "parallelism_config_",
    "mpirun_config": "mpirun_",
}
# Settings of `accelerate tpu-config` kept in the same file: TPU settings.
_TPU_KEYS = {"tpu_name", "tpu_zone", "tpu_vm", "tpu_env", "commands", "command_file"}
_TOP_LEVEL = {
    "mixed_precision", "use_cpu", "debug", "num_processes", "machine_rank", "num_machines",
    "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
    "main_training_function", "enable_cpu_affinity", "downcast_bf16", "tpu_use_cluster",
    "tpu_use_sudo",
    "num_cpu_threads_per_process", "max_restarts", "monitor_interval", "tee", "log_dir", "role",
    "rdzv_conf", "module", "no_python", "quiet",
}  # fmt: skip
_DISTRIBUTED_TYPES = {
    "NO": {},
    "MULTI_CPU": {},
    "MULTI_GPU": {"multi_gpu": True},
    "FSDP": {"use_fsdp": True},
}
_REFUSED_TYPES = {
    "DEEPSPEED": "DeepSpeed is not supported by accelkit; use distributed_type FSDP.",
    "MEGATRON_LM": "Megatron-LM is not supported by accelkit (out of scope).",
    "XLA": "TPU/XLA execution is out of scope for accelkit.",
    "TPU": "TPU/XLA execution is out of scope for accelkit.",
}


def default_config_path() -> str:
    """Where ``accelerate config`` puts its file, and where ``accelkit launch`` looks for it."""
    hf_home = os.environ.get(
        "HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    )
    return os.path.join(os.path.expanduser(hf_home), "accelerate", "default_config.yaml")


def _load(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(
            f"Config file {path!r} does not exist. Write one with `accelkit config` (or "
            "`accelkit config default`), or pass an existing file to --config_file."
        ) from None
    except yaml.YAMLError as exc:
        raise ValueError(f"Config file {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"Config file {path!r} must hold a mapping of settings, got {type(data).__name__}."
        )
    return data


def read_config_file(path: str) -> dict[str, Setting]:
    """The launch settings in the config file at ``path``, by flag name.

    Raises:
        ValueError: the file is missing or malformed, or asks for something accelkit refuses
            (naming the file, the key and the reason).
    """
    data = _load(path)

    def origin(key: str) -> str:
        return f"config file {path}: {key}"

    settings: dict[str, Setting] = {}
    environment = str(data.get("compute_environment", "LOCAL_MACHINE"))
    if environment != "LOCAL_MACHINE":
        raise ValueError(
            f"{origin('compute_environment')} ({environment!r}): only LOCAL_MACHINE is "
            "supported (launching on Amazon SageMaker is not)."
        )
    kind = data.get("distributed_type", "NO")
    # YAML 1.1 reads an unquoted NO as false; the reference quotes it, a hand-written file may not.
    kind = "NO" if kind is False else str(kind).upper()
    if kind in _REFUSED_TYPES:
        raise ValueError(f"{origin('distributed_type')} ({kind!r}): {_REFUSED_TYPES[kind]}")
    if kind not in _DISTRIBUTED_TYPES:
        raise ValueError(
            f"{origin('distributed_type')} ({kind!r}) is not supported; accelkit runs "
            f"{', '.join(_DISTRIBUTED_TYPES)} (CPUs and CUDA GPUs)."
        )
    for flag, value in _DISTRIBUTED_TYPES[kind].items():
        settings[flag] = Setting(value, origin("distributed_type"))
    for key, value in data.items():
        if key in _STRUCTURE or value is None:
            continue
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"{origin(key)} must be a mapping, got {value!r}.")
            prefix = _SECTIONS[key]
            for sub, sub_value in value.items():
                flag = sub if sub.startswith(prefix) else prefix + sub
                settings[flag] = Setting(sub_value, origin(f"{key}.{sub}"))
            continue
        flag = _RENAMED.get(key, key)
        if key in _TPU_KEYS:
            flag = key if key.startswith("tpu_") else f"tpu_{key}"
        elif key not in _TOP_LEVEL and refusal_for(key) is None:
            raise ValueError(
                f"{origin(key)} is not a setting of `accelerate launch` that accelkit knows; "
                "remove it from the file."
            )
        settings[flag] = Setting(value, origin(key))
    return settings


def write_config_file(path: str, settings: dict[str, Any]) -> None:
    """Write ``settings`` (reference key names) to ``path`` as YAML, creating its folder.

    Raises:
        FileExistsError: ``path`` exists (the caller decides whether to overwrite).
    """
    import yaml

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "x", encoding="utf-8") as f:
        yaml.safe_dump(settings, f, sort_keys=True)


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def default_settings(mixed_precision: str = "no", gpus: int | None = None) -> dict[str, Any]:
    """The settings for this machine that ``accelkit config default`` and
    :func:`write_basic_config` write: every GPU here, or one CPU process."""
    gpus = _gpu_count() if gpus is None else gpus
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
        "mixed_precision": mixed_precision,
        "num_processes": max(gpus, 1),
        "num_machines": 1,
        "machine_rank": 0,
        "use_cpu": gpus == 0,
        "debug": False,
        "enable_cpu_affinity": False,
        "rdzv_backend": "static",
        "same_network": True,
    }


def write_basic_config(
    mixed_precision: str = "no", save_location: str | None = None
) -> Literal[False] | Path:
    """Write the launch config file for this machine, as ``accelkit config default`` does
    (Accelerate's ``write_basic_config``): every GPU here, or one CPU process.

    An existing file is kept: a message says so and False is returned.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        save_location: where to write (default: :func:`default_config_path`, where
            ``accelkit launch`` and ``accelerate launch`` look); pass it to ``--config_file``
            otherwise.

    Returns:
        The path written, or False when the file already existed.

    Raises:
        ValueError: for another ``mixed_precision`` (``"fp8"`` is out of scope).
    """
    precision = parse_mixed_precision(mixed_precision.lower()).value
    path = Path(save_location or default_config_path())
    try:
        write_config_file(str(path), default_settings(precision))
    except FileExistsError:
        print(
            f"Configuration already exists at {path}, will not override. Run `accelkit config` "
            "or pass a different save_location."
        )
        return False
    return path
