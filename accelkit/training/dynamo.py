"""``torch.compile`` of prepared models: ``Accelerator(dynamo_backend=...)`` / ``dynamo_plugin``.

The settings are read as in the reference: explicit arguments first, then the launcher's
environment (``ACCELKIT_DYNAMO_BACKEND``/``ACCELERATE_DYNAMO_BACKEND``, ``..._MODE``,
``..._USE_FULLGRAPH``, ``..._USE_DYNAMIC``, ``..._USE_REGIONAL_COMPILATION``). With a backend
other than ``"no"``, ``prepare`` compiles each model after wrapping it (DDP, autocast), and
``unwrap_model(model, keep_torch_compile=False)`` returns the uncompiled module.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

import torch

from accelkit.errors import ConfigurationError
from accelkit.training.kwargs_handlers import KwargsHandler

__all__ = [
    "DynamoBackend",
    "TorchDynamoPlugin",
    "compile_model",
    "compile_regions",
    "has_compiled_regions",
    "resolve_dynamo_plugin",
]

_TRUE = {"1", "true", "yes", "on", "y", "t"}


class DynamoBackend(str, enum.Enum):
    """``torch.compile`` backends by the reference's names (``NO`` disables compilation).

    A backend PyTorch does not know (or whose package is missing) fails in ``torch.compile``,
    naming it; the XLA ones are out of accelkit's scope and refused up front.
    """

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


_OUT_OF_SCOPE = {DynamoBackend.AOT_TORCHXLA_TRACE_ONCE, DynamoBackend.TORCHXLA_TRACE_ONCE}


def _env(suffix: str) -> str | None:
    for prefix in ("ACCELKIT_DYNAMO_", "ACCELERATE_DYNAMO_"):
        value = os.environ.get(prefix + suffix)
        if value is not None:
            return value
    return None


def _env_bool(suffix: str) -> bool | None:
    value = _env(suffix)
    return None if value is None else value.strip().lower() in _TRUE


def _backend(value: Any) -> DynamoBackend:
    text = value.value if isinstance(value, DynamoBackend) else str(value).upper()
    try:
        backend = DynamoBackend(text)
    except ValueError:
        accepted = ", ".join(repr(b.value.lower()) for b in DynamoBackend)
        raise ConfigurationError(
            f"Unknown dynamo backend {value!r}. Expected one of {accepted}."
        ) from None
    if backend in _OUT_OF_SCOPE:
        raise ConfigurationError(
            f"dynamo backend {backend.value.lower()!r} compiles for XLA/TPU, which accelkit does "
            "not support; use 'inductor' (or 'no')."
        )
    return backend


@dataclasses.dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How ``prepare`` compiles models with ``torch.compile``.

    Args:
        backend: a :class:`DynamoBackend` or its name (case-insensitive); default from the
            environment, else ``"no"``.
        mode: ``torch.compile``'s mode (``"default"``, ``"reduce-overhead"``, ...).
        fullgraph: refuse graph breaks.
        dynamic: dynamic shapes (None: PyTorch decides).
        options: backend options passed to ``torch.compile``.
        disable: turn ``torch.compile`` into a no-op.
        use_regional_compilation: compile each repeated block (the children of every
            ``nn.ModuleList``) instead of the whole model, which compiles faster.
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        self.backend = _backend(
            self.backend if self.backend is not None else _env("BACKEND") or "no"
        )
        if self.mode is None:
            self.mode = _env("MODE") or "default"
        if self.fullgraph is None:
            self.fullgraph = bool(_env_bool("USE_FULLGRAPH"))
        if self.dynamic is None:
            self.dynamic = _env_bool("USE_DYNAMIC")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = bool(_env_bool("USE_REGIONAL_COMPILATION"))

    @property
    def enabled(self) -> bool:
        """Whether models are compiled."""
        return self.backend is not DynamoBackend.NO and not self.disable

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (``backend`` lower-case), as the reference reports them."""
        out = dataclasses.asdict(self)
        out["backend"] = _backend(self.backend).value.lower()
        return out

    def to_kwargs(self) -> dict[str, Any]:
        """The settings that differ from the defaults (``backend`` lower-case), without
        ``use_regional_compilation``, which is accelkit's choice, not ``torch.compile``'s (as
        Accelerate leaves it out)."""
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        return kwargs

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.compile``."""
        kwargs: dict[str, Any] = {
            "backend": _backend(self.backend).value.lower(),
            "mode": None if self.mode == "default" else self.mode,
            "fullgraph": bool(self.fullgraph),
            "dynamic": self.dynamic,
            "disable": self.disable,
        }
        if self.options is not None:
            kwargs["options"] = self.options
            kwargs.pop("mode")  # torch.compile takes one of mode / options
        return kwargs


def resolve_dynamo_plugin(plugin: TorchDynamoPlugin | None, backend: Any) -> TorchDynamoPlugin:
    """The plugin ``Accelerator(dynamo_backend=..., dynamo_plugin=...)`` asks for.

    Raises:
        ValueError: when both are given (they would contradict each other).
    """
    if plugin is not None and backend is not None:
        raise ConfigurationError(
            "Pass either dynamo_backend=... or dynamo_plugin=TorchDynamoPlugin(...) to "
            "Accelerator, not both."
        )
    return plugin if plugin is not None else TorchDynamoPlugin(backend=backend)


def compile_model(model: torch.nn.Module, plugin: TorchDynamoPlugin) -> torch.nn.Module:
    """Compile ``model`` as ``plugin`` says (returned unchanged when compilation is off).

    With ``use_regional_compilation`` each child of every ``nn.ModuleList`` is compiled in
    place and the model itself is returned; otherwise the ``torch.compile`` wrapper is.
    """
    if not plugin.enabled:
        return model
    kwargs = plugin.compile_kwargs()
    if plugin.use_regional_compilation:
        return compile_regions(model, **kwargs)
    return torch.compile(model, **kwargs)  # type: ignore[return-value]


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Compile each child of every ``nn.ModuleList`` of ``module`` in place (regional
    compilation: repeated blocks compile once and reuse the code); returns ``module``.

    Args:
        module: the model.
        **compile_kwargs: ``torch.compile`` arguments.
    """
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList):
            for i, child in enumerate(sub):
                if not isinstance(child, torch._dynamo.eval_frame.OptimizedModule):
                    sub[i] = torch.compile(child, **compile_kwargs)  # type: ignore[assignment]
    return module


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether some submodule of ``module`` was compiled by :func:`compile_regions`."""
    return any(
        isinstance(sub, torch._dynamo.eval_frame.OptimizedModule) for sub in module.modules()
    )
