"""Small helpers of the reference's ``accelerate.utils`` that scripts call directly."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from accelkit.data.batches import find_batch_size
from accelkit.errors import ConfigurationError
from accelkit.runtime.environment import clear_environment
from accelkit.runtime.ops import recursively_apply

__all__ = [
    "clear_environment",
    "convert_bytes",
    "convert_file_size_to_int",
    "convert_to_fp32",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_device",
    "get_int_from_env",
    "get_pretty_name",
    "honor_type",
    "ignorant_find_batch_size",
    "is_compiled_module",
    "is_peft_model",
    "is_namedtuple",
    "is_port_in_use",
    "is_torch_tensor",
    "listify",
    "merge_dicts",
    "model_has_dtensor",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "recursive_getattr",
    "str_to_bool",
    "tqdm",
    "wait_for_everyone",
]

_TRUE = {"y", "yes", "t", "true", "on", "1"}
_FALSE = {"n", "no", "f", "false", "off", "0"}


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``"yes"``/``"true"``/``"1"``/... -> 1 (or True); ``"no"``/``"false"``/``"0"``/... -> 0.

    Raises:
        ValueError: for any other text.
    """
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ConfigurationError(
        f"Invalid truth value {value!r}; expected one of {sorted(_TRUE | _FALSE)}."
    )


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """A boolean environment variable (see :func:`str_to_bool`)."""
    return bool(str_to_bool(os.environ.get(key, str(default)), to_bool=True))


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """An environment variable's value, or ``default``."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first of ``env_keys`` set to a non-negative integer, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (upper-cased names) inside the block; restore them after."""
    saved: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = key.upper()
        saved[name] = os.environ.get(name)
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def listify(data: Any) -> Any:
    """Tensors in a nested structure as Python lists/numbers (``tensor.tolist()``)."""
    if isinstance(data, torch.Tensor):
        return data.tolist()
    return recursively_apply(lambda t: t.tolist(), data)


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16/bfloat16 tensor in a nested structure cast to float32."""

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    return one(tensor) if isinstance(tensor, torch.Tensor) else recursively_apply(one, tensor)


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor``."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is an instance of a ``namedtuple`` class."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterator[Any]) -> Any:
    """Build an object of ``obj``'s sequence type (namedtuples included) from ``generator``."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def ignorant_find_batch_size(data: Any) -> int | None:
    """:func:`find_batch_size`, or None when there is no tensor."""
    try:
        return find_batch_size(data)
    except ValueError:
        return None


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in a nested structure (None without tensors)."""
    if isinstance(data, torch.Tensor):
        return data.device
    values = data.values() if isinstance(data, Mapping) else data
    if isinstance(values, (list, tuple)) or isinstance(data, Mapping):
        for item in values:
            device = find_device(item)
            if device is not None:
                return device
    return None


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def extract_model_from_parallel(
    model: torch.nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> torch.nn.Module:
    """The model inside DDP (and optionally autocast / ``torch.compile``) wrappers.

    ``recursive`` is accepted for compatibility: accelkit's wrappers are never nested inside
    submodules, so unwrapping the top level is complete.
    """
    from accelkit.training.loop import unwrap_model

    return unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (False when peft is not installed)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (e.g. sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


_SIZE_UNITS = {
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "B": 1,
}


def convert_file_size_to_int(size: int | str) -> int:
    """``"10GB"`` -> 10_000_000_000, ``"1GiB"`` -> 1_073_741_824; an int is returned as it is.

    Raises:
        ValueError: for text that is not a number followed by B, KB, MB, GB, TB, KiB, ... TiB.
    """
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in _SIZE_UNITS.items():
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                value = float(number)
            except ValueError:
                break
            return int(value * factor)
    raise ConfigurationError(
        f"Cannot read the size {size!r}; write an int or a number with a unit, e.g. '10GB', "
        "'500MB', '1GiB'."
    )


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm`` that, by default, shows its bar on the local main process only."""
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


def wait_for_everyone() -> None:
    """Barrier across all processes (a no-op without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``port`` (default 29500) on 127.0.0.1."""
    port = 29500 if port is None else port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def convert_bytes(size: float) -> str:
    """A byte count as text with a binary unit, e.g. ``"1.5 GB"``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def get_pretty_name(obj: Any) -> str:
    """The qualified name of a class, function, or of an object's class."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = type(obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", str(obj)))


def merge_dicts(source: dict[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged); returns it."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path, e.g. ``recursive_getattr(model, "encoder.layer")``."""
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj
