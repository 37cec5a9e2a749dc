"""The training-loop machinery behind the ``Accelerator`` facade.

What ``prepare`` does with each kind of object, how models are wrapped (device, DDP, autocast)
and unwrapped, gradient synchronisation control (``no_sync``, ``trigger_sync_in_backward``,
``join_uneven_inputs``), gradient clipping with an fp16 scaler, and ``gather_for_metrics``.
Functions take what they need explicitly; none of them reads global state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler

from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.runtime import ops
from accelkit.training import precision
from accelkit.training.optim import AcceleratedOptimizer, GradientState
from accelkit.training.wrapping import peel

__all__ = [
    "check_preparable",
    "gather_for_metrics",
    "is_scheduler",
    "join_uneven_inputs",
    "no_sync",
    "prepare_model",
    "trigger_sync_in_backward",
    "unscale_and_clip",
    "unwrap_model",
]

_PREPARABLE = (torch.nn.Module, torch.optim.Optimizer, DataLoader)


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is a PyTorch learning-rate scheduler (incl. ``ReduceLROnPlateau``)."""
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler)


def check_preparable(obj: Any) -> None:
    """Refuse objects that ``prepare`` would otherwise pass through by mistake.

    ``prepare`` wraps models, optimizers, schedulers and dataloaders and, like the reference,
    returns any other object unchanged (a tokenizer, a config). A few objects are almost always
    a mistake, and passing them through would only fail later, far from the cause, so they are
    refused here: a ``Dataset`` or ``Sampler`` (it needs a ``DataLoader`` around it), a class
    instead of an instance, and a list/tuple/dict holding preparable objects (unpack it).

    Raises:
        TypeError: naming the object's type and the fix.
    """
    if isinstance(obj, type) and issubclass(obj, (*_PREPARABLE, Dataset)):
        raise WrongTypeError(
            f"prepare() got the class {obj.__name__}, not an instance of it; create the object "
            f"first, e.g. prepare({obj.__name__}(...))."
        )
    if isinstance(obj, (Dataset, Sampler)) and not isinstance(obj, DataLoader):
        raise WrongTypeError(
            f"prepare() cannot handle a {type(obj).__name__}: it shards DataLoaders, not "
            f"datasets or samplers. Wrap it first: DataLoader(dataset, batch_size=..., "
            f"shuffle=...), then prepare the DataLoader."
        )
    if isinstance(obj, (list, tuple, dict)):
        values = obj.values() if isinstance(obj, dict) else obj
        found = [type(v).__name__ for v in values if isinstance(v, _PREPARABLE) or is_scheduler(v)]
        if found:
            raise WrongTypeError(
                f"prepare() got a {type(obj).__name__} holding {', '.join(found)}; it does not "
                "look inside containers. Pass the objects themselves: prepare(*objects)."
            )


def prepare_model(
    model: torch.nn.Module,
    *,
    device: torch.device | None,
    mixed_precision: str,
    distributed: bool,
    evaluation_mode: bool = False,
    ddp_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move ``model`` to ``device``, install the autocast forward, and wrap it in DDP.

    Args:
        model: the model.
        device: target device (None: leave the model where it is).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        distributed: wrap in ``DistributedDataParallel`` (skipped when nothing is trainable).
        evaluation_mode: never wrap in DDP (inference only).
        ddp_kwargs: extra ``DistributedDataParallel`` arguments.
    """
    if isinstance(model, DistributedDataParallel):
        return model
    if device is not None:
        model = model.to(device)
    precision.wrap_forward(model, mixed_precision, device or _model_device(model))
    if distributed and not evaluation_mode and any(p.requires_grad for p in model.parameters()):
        model_device = device or _model_device(model)
        device_ids = [model_device.index] if model_device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, **(ddp_kwargs or {}))
    return model


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def unwrap_model(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """Peel off what ``prepare`` (and ``torch.compile``) put around ``model``.

    With ``keep_torch_compile`` the result is compiled around the bare model, as in Accelerate
    (state-dict keys ``_orig_mod.*``): for ``torch.compile(DDP(m))`` a new compiled wrapper
    of ``m`` (same parameters, same compile settings). Accelerate instead swaps the inner
    module of the compiled model it was given, so the model being trained no longer runs
    through DDP; here the given model is left as it is.

    Args:
        model: a prepared model.
        keep_fp32_wrapper: keep the autocast forward (False removes it from the model).
        keep_torch_compile: keep a ``torch.compile`` wrapper.
    """
    model, compiled = peel(model)
    if not keep_fp32_wrapper:
        precision.unwrap_forward(model)
    if keep_torch_compile and compiled is not None:
        if getattr(compiled, "_orig_mod", None) is model:
            return compiled
        return type(compiled)(model, compiled.dynamo_ctx)
    return model


def no_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """DDP's ``no_sync()`` for a DDP model, a null context for any other."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    from accelkit.fsdp.runtime import no_sync as fsdp_no_sync  # FSDP2: skip the reduce-scatter

    return fsdp_no_sync(model)


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Make the next backward of a DDP ``model`` all-reduce, even inside ``no_sync``."""
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    old = (model.require_backward_grad_sync, model.require_forward_param_sync)
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    # The reducer must expect this backward; DDP normally arms it in forward().
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old


@contextlib.contextmanager
def join_uneven_inputs(
    joinables: Sequence[Any], loaders: Iterable[Any], even_batches: bool | None, distributed: bool
) -> Iterator[None]:
    """``torch.distributed.algorithms.Join`` over ``joinables``, overriding ``even_batches``.

    Args:
        joinables: DDP models (and other ``Joinable`` objects).
        loaders: prepared dataloaders whose ``even_batches`` the override applies to.
        even_batches: temporary setting for map-style loaders (None: keep theirs).
        distributed: whether the processes are joined by DDP (otherwise, as in the reference, a
            ``UserWarning`` says the block has no effect, and it runs as it is).
    """
    if not distributed:
        warnings.warn(
            "Joining uneven inputs is only supported for multi-GPU / multi-CPU (DDP) training; "
            "`join_uneven_inputs` has no effect here.",
            UserWarning,
            stacklevel=3,
        )
        yield
        return
    from torch.distributed.algorithms.join import Join

    changed: list[tuple[Any, bool]] = []
    if even_batches is not None:
        iterable = False
        for loader in loaders:
            shard = getattr(loader, "_shard", None)
            if shard is not None:
                changed.append((shard, shard.even_batches))
                shard.even_batches = even_batches
            else:
                iterable = True
        if iterable:
            warnings.warn(
                "Overriding even_batches is only supported for map-style datasets, yet some "
                "dataloaders given were iterable; their even_batches setting is unchanged.",
                UserWarning,
                stacklevel=3,
            )
    ddp_models: list[Any] = [j for j in joinables if isinstance(j, DistributedDataParallel)]
    try:
        with Join(ddp_models) if ddp_models else contextlib.nullcontext():
            yield
    finally:
        for shard, value in changed:
            shard.even_batches = value


def unscale_gradients(
    optimizers: Iterable[Any], prepared: Sequence[AcceleratedOptimizer], state: GradientState
) -> None:
    """Unscale the fp16 gradients of ``optimizers`` (once per optimizer step; final steps only).

    While gradients still accumulate, unscaling would mix scaled and unscaled values in the
    same ``.grad``, so nothing happens until the synchronising micro-step.
    """
    if not state.sync_gradients:
        return
    for opt in optimizers:
        wrapper = _find_wrapper(opt, prepared)
        if wrapper is not None:
            wrapper.unscale_()


def _find_wrapper(
    opt: Any, prepared: Sequence[AcceleratedOptimizer]
) -> AcceleratedOptimizer | None:
    if isinstance(opt, AcceleratedOptimizer):
        return opt
    for wrapper in prepared:
        if wrapper.optimizer is opt:
            return wrapper
    return None


def unscale_and_clip(
    clip: Callable[[], Any],
    prepared: Sequence[AcceleratedOptimizer],
    state: GradientState,
    scaler: torch.amp.GradScaler | None,
) -> Any:
    """Unscale every prepared optimizer's gradients, then run ``clip``.

    With an fp16 scaler on a micro-step whose gradients still accumulate, the gradients are
    scaled and partial: ``clip`` is not run (clipping them would corrupt the sum) and None is
    returned. Clip under ``if accelerator.sync_gradients:`` to avoid that case.
    """
    if scaler is not None and not state.sync_gradients:
        return None
    unscale_gradients(prepared, prepared, state)
    return clip()


def gather_for_metrics(input_data: Any, state: GradientState, use_gather_object: bool) -> Any:
    """Gather ``input_data`` from all processes, dropping the padding of the last batch.

    Args:
        input_data: tensors (nested lists/tuples/dicts) or, with ``use_gather_object`` or when
            not all tensors, any picklable objects (one list item per sample).
        state: the accelerator's gradient state (which knows the active loader's remainder).
        use_gather_object: gather with pickling instead of tensor collectives.
    """
    if not use_gather_object:
        try:
            ops.recursively_apply(lambda t: t, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
    data = ops.gather_object(input_data) if use_gather_object else ops.gather(input_data)
    if not state.end_of_dataloader:
        return data
    remainder = state.remainder
    if remainder <= 0:
        return data
    if use_gather_object:
        return data[:remainder]
    return ops.recursively_apply(lambda t: t[:remainder], data)


def prepare_all(
    objects: Sequence[Any],
    device_placement: Sequence[bool] | None,
    prepare_one: Callable[[Any, bool | None], Any],
) -> tuple[Any, ...]:
    """Check and prepare ``objects`` in order, schedulers last (they follow the optimizers).

    Raises:
        ValueError: if ``device_placement`` does not have one entry per object.
        TypeError: see :func:`check_preparable`.
    """
    if device_placement is None:
        placements: list[bool | None] = [None] * len(objects)
    else:
        placements = list(device_placement)
        if len(placements) != len(objects):
            raise ConfigurationError(
                f"device_placement has {len(placements)} entries for {len(objects)} objects; "
                "give one bool per object passed to prepare()."
            )
    for obj in objects:
        check_preparable(obj)
    result = list(objects)
    for second_pass in (False, True):
        for i, obj in enumerate(objects):
            if is_scheduler(obj) == second_pass:
                result[i] = prepare_one(obj, placements[i])
    return tuple(result)


def register(registry: list[Any], obj: Any) -> Any:
    """Append ``obj`` to ``registry`` unless it is already there (by identity); return it."""
    if not any(existing is obj for existing in registry):
        registry.append(obj)
    return obj


def optimizers_of(
    scheduler: Any, prepared: Sequence[AcceleratedOptimizer]
) -> list[AcceleratedOptimizer]:
    """The prepared optimizers that ``scheduler`` drives."""
    target = getattr(scheduler, "optimizer", None)
    return [opt for opt in prepared if opt is target or opt.optimizer is target]


def handler_kwargs(handler: Any) -> dict[str, Any]:
    """Keyword arguments from a kwargs handler (``to_kwargs()``), a dict, or None."""
    if handler is None:
        return {}
    if isinstance(handler, dict):
        return dict(handler)
    to_kwargs = getattr(handler, "to_kwargs", None)
    if callable(to_kwargs):
        return dict(to_kwargs())
    raise WrongTypeError(
        f"Expected a kwargs handler with to_kwargs() or a dict, got {type(handler).__name__}."
    )


def as_list(obj: Any) -> list[Any]:
    """``obj`` as a list (lists and tuples are copied, anything else wrapped)."""
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def release_memory(count: int) -> Any:
    """Collect garbage and empty the CUDA cache; return ``count`` Nones (one: None itself)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None if count <= 1 else (None,) * count
