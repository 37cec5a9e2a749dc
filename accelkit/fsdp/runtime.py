"""Sharded data parallelism with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

accelkit writes no sharding engine of its own. :class:`FullyShardedDataParallelPlugin` (the
name the reference documents) holds the options; :func:`shard_model` applies ``fully_shard`` to
the chosen sub-modules and the root over a 1-D device mesh of all processes; the helpers below
give the rest of the toolkit what it needs from a sharded model (full or sharded state dicts,
gradient clipping on DTensor gradients, re-pointing an optimizer created before sharding).

Optimizers: FSDP2 replaces a module's parameters by new ``DTensor`` parameters, so an optimizer
created before sharding would update tensors the model no longer uses. Like the reference,
accelkit lets a user create the optimizer first: :meth:`FSDPRuntime.prepare_model` records which
parameter became which, and every optimizer prepared before or after the model is re-pointed to
the sharded parameters (:func:`repoint_optimizer`). An optimizer that already holds state (it has
stepped) cannot be re-pointed safely and is refused with an error saying to prepare first.

The plugin and the ``accelkit launch --use_fsdp --fsdp_*`` flags live in
:mod:`accelkit.fsdp.plugin` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from accelkit.errors import ConfigurationError, UsageError
from accelkit.fsdp.plugin import (
    ENV_USE_FSDP,
    FullyShardedDataParallelPlugin,
    add_launch_arguments,
    fully_shard_function,
    launch_env,
    plugin_from_env_or,
)

__all__ = [
    "ENV_USE_FSDP",
    "FSDPRuntime",
    "FullyShardedDataParallelPlugin",
    "ParamRemap",
    "add_launch_arguments",
    "clip_grad_norm_",
    "get_optimizer_state_dict",
    "get_state_dict",
    "is_sharded",
    "launch_env",
    "no_sync",
    "plugin_from_env_or",
    "repoint_optimizer",
    "gather_full_model",
    "set_optimizer_state_dict",
    "set_state_dict",
    "shard_model",
    "wrap_units",
]


# ------------------------------------------------------------------ sharding


def ensure_process_group(device: torch.device) -> None:
    """FSDP needs a process group; a single process without one gets a 1-rank group.

    A launched multi-process job has its group from :class:`~accelkit.runtime.state.PartialState`; a
    plain ``python train.py`` gets a private one-process group (an in-memory store), so the
    same script and the same sharded checkpoints work on one process.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def device_mesh(device: torch.device) -> Any:
    """A 1-D device mesh over every process of the default group."""
    from torch.distributed.device_mesh import init_device_mesh

    ensure_process_group(device)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded by ``fully_shard`` (FSDP2).

    Cheap for runs without FSDP: if ``torch.distributed.fsdp`` was never imported (it takes
    seconds to import), nothing can have been sharded, and it is not imported here.
    """
    module = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(module, "FSDPModule", None)
    return fsdp_module is not None and isinstance(model, fsdp_module)


def wrap_units(model: nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[nn.Module]:
    """The sub-modules the plugin shards separately, children before parents (the order
    ``fully_shard`` needs); the root, always sharded last, is not included.

    Raises:
        ValueError: if ``transformer_cls_names_to_wrap`` names a class absent from the model.
    """
    chosen: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        own = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            own += visit(child, False)
        if not is_root and own and plugin.wraps(module, own):
            chosen.append(module)
            return 0
        return own

    visit(model, True)
    if plugin.auto_wrap_policy == "transformer_based_wrap":
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in plugin.transformer_cls_names_to_wrap or () if n not in present]
        if missing:
            raise ConfigurationError(
                f"transformer_cls_names_to_wrap names {missing}, but the model has no module of "
                f"that class. Classes in the model: {', '.join(sorted(present))}."
            )
    return chosen


ParamRemap = dict[int, tuple["weakref.ref[nn.Parameter]", nn.Parameter]]
"""``id(old parameter) -> (weak reference to it, new sharded parameter)``.

The weak reference makes a stale entry harmless: once an old parameter is freed its id may be
reused by an unrelated tensor, which must not be swapped (nor kept alive: it may be large).
"""


def shard_model(
    model: nn.Module,
    plugin: FullyShardedDataParallelPlugin,
    device: torch.device,
    mixed_precision: str = "no",
    mesh: Any = None,
) -> ParamRemap:
    """Shard ``model`` in place with ``fully_shard`` per the plugin.

    Args:
        model: the model (moved to ``device`` first).
        plugin: the options.
        device: this process's device.
        mixed_precision: the accelerator's setting, used when the plugin has no policy.
        mesh: a device mesh (default: all processes, :func:`device_mesh`).

    Returns:
        Old parameter -> new sharded parameter (:data:`ParamRemap`), to re-point optimizers
        created before sharding.

    Raises:
        ValueError: for options this torch lacks, or wrap class names absent from the model.
    """
    fully_shard = fully_shard_function()
    kwargs = plugin.fully_shard_kwargs_for(device, mixed_precision)
    before = list(model.named_parameters(remove_duplicate=False))
    model.to(device)  # in place: the same Parameter objects, possibly new data
    before += list(model.named_parameters(remove_duplicate=False))
    mesh = mesh if mesh is not None else device_mesh(device)
    for unit in wrap_units(model, plugin):
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    new = dict(model.named_parameters(remove_duplicate=False))
    return {id(p): (weakref.ref(p), new[name]) for name, p in before if name in new}


def _same(ref: weakref.ref[nn.Parameter], obj: object) -> bool:
    return ref() is obj


def repoint_optimizer(optimizer: Any, remap: ParamRemap) -> int:
    """Make ``optimizer`` (or a wrapper's ``.optimizer``) update the sharded parameters.

    Returns:
        How many parameter references were replaced.

    Raises:
        RuntimeError: if the optimizer already has state for a replaced parameter.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return 0
    replaced = 0
    for group in inner.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            entry = remap.get(id(p))
            if entry is None or not _same(entry[0], p) or entry[1] is p:
                continue
            if inner.state.get(p):
                raise UsageError(
                    f"{type(inner).__name__} already holds state (it has stepped) for a "
                    "parameter that FSDP has just sharded; that state cannot follow the "
                    "parameter. Call accelerator.prepare(model, optimizer) before training "
                    "(or create the optimizer after preparing the model)."
                )
            params[i] = entry[1]
            replaced += 1
    return replaced


class FSDPRuntime:
    """What an ``Accelerator`` with an ``fsdp_plugin`` does in ``prepare``.

    Args:
        plugin: the options.
        device: the accelerator's device.
        mixed_precision: the accelerator's mixed-precision setting.
    """

    def __init__(
        self, plugin: FullyShardedDataParallelPlugin, device: torch.device, mixed_precision: str
    ) -> None:
        self.plugin = plugin
        self.device = device
        self.mixed_precision = mixed_precision
        self._remap: ParamRemap = {}
        self._mesh: Any = None

    @classmethod
    def create(cls, plugin: Any, device: torch.device, mixed_precision: str) -> FSDPRuntime | None:
        """A runtime for ``plugin`` (or the launcher's FSDP settings); None without FSDP."""
        resolved = plugin_from_env_or(plugin)
        return None if resolved is None else cls(resolved, device, mixed_precision)

    def prepare_model(self, model: nn.Module, optimizers: Iterable[Any] = ()) -> nn.Module:
        """Shard ``model`` (once) and re-point ``optimizers`` prepared before it."""
        if is_sharded(model):
            return model
        if self._mesh is None:
            self._mesh = device_mesh(self.device)
        remap = shard_model(model, self.plugin, self.device, self.mixed_precision, self._mesh)
        self._remap.update(remap)
        for optimizer in optimizers:
            repoint_optimizer(optimizer, self._remap)
        return model

    def prepare_optimizer(self, optimizer: Any) -> Any:
        """Re-point an optimizer created before its model was sharded; returns it."""
        repoint_optimizer(optimizer, self._remap)
        return optimizer


# ------------------------------------------------------------------ state dicts


def _options(full_state_dict: bool, cpu_offload: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload)


def get_state_dict(
    model: nn.Module, full_state_dict: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The state dict of ``model``; for a sharded model, a collective (call on every process).

    Args:
        model: a sharded or ordinary model.
        full_state_dict: gather full tensors (only the main process receives them, others get
            ``{}``); False returns this process's ``DTensor`` shards.
        cpu_offload: put the gathered tensors in CPU memory.
    """
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict, cpu_offload))


def set_state_dict(model: nn.Module, state_dict: dict[str, Any], full_state_dict: bool) -> None:
    """Load ``state_dict`` (full or sharded, see :func:`get_state_dict`) into ``model``."""
    if not is_sharded(model):
        model.load_state_dict(state_dict)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state_dict, options=_options(full_state_dict, False))


def get_optimizer_state_dict(
    model: nn.Module, optimizer: Any, full_state_dict: bool = False
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names (sharded unless ``full_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as get

    inner = getattr(optimizer, "optimizer", optimizer)
    return get(model, inner, options=_options(full_state_dict, full_state_dict))


def set_optimizer_state_dict(
    model: nn.Module, optimizer: Any, state_dict: dict[str, Any], full_state_dict: bool = False
) -> None:
    """Load a state dict from :func:`get_optimizer_state_dict` into ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as put

    inner = getattr(optimizer, "optimizer", optimizer)
    put(model, inner, state_dict, options=_options(full_state_dict, False))


class _StateDictView(nn.Module):
    """A module stand-in whose ``state_dict()`` is a given mapping (for the model writer)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        super().__init__()
        self._tensors = tensors

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._tensors


def gather_full_model(model: nn.Module) -> nn.Module | None:
    """The full (unsharded) tensors of a sharded model, gathered in CPU memory on the main
    process, as a module whose ``state_dict()`` returns them (``None`` on other processes).

    A collective: call it on every process. Writing them is the caller's business (the
    checkpointing layer), so this module never imports it.
    """
    state = get_state_dict(model, full_state_dict=True, cpu_offload=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return _StateDictView(state)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip FSDP2's gradient reduce-scatter inside the block (gradient accumulation).

    Gradients then accumulate unsharded on each process until a backward outside the block.
    A null context for a model that is not sharded.
    """
    if not is_sharded(model):
        yield
        return
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also takes sharded (``DTensor``) gradients.

    Returns the total norm over all shards as a plain tensor, the same on every process (a
    collective when gradients are sharded: call it on every process).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    full_tensor = getattr(total, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else total
