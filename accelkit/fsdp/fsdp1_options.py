"""Accelerate's FSDP1 plugin options, translated to FSDP2 or refused by name with the reason.

``FullyShardedDataParallelPlugin`` takes the reference's parameters in the reference's order so
that scripts bind the same way. accelkit shards with FSDP2 (``fully_shard``) only, so each FSDP1
option either has an FSDP2 meaning (translated here), is ignored with a warning where the
reference's FSDP2 mode ignores it too, or is refused with what to do instead.

* ``sharding_strategy``: ``FULL_SHARD`` is ``reshard_after_forward=True``, ``SHARD_GRAD_OP`` is
  ``False``; ``NO_SHARD`` (that is DDP) and the hybrid strategies are refused.
* ``state_dict_type``: names, ``StateDictType`` members or their numbers.
* ``cpu_offload``: FSDP1's ``CPUOffload(offload_params=...)`` is its ``offload_params``.
* ignored with a warning, as in the reference's FSDP2 mode: ``backward_prefetch``,
  ``use_orig_params``, ``sync_module_states``, ``limit_all_gathers``.
* ``state_dict_config``: a ``FullStateDictConfig`` asks for what ``save_model`` writes (one
  full state dict, gathered into CPU memory on the main process) and is accepted; its
  ``offload_to_cpu=False``/``rank0_only=False`` are ignored with a warning, as are the other
  state-dict configs (``save_state`` writes sharded state through torch.distributed.checkpoint)
  and every ``optim_state_dict_config``. Anything that is not a torch state-dict config is
  refused.
* refused unless left at their defaults: ``forward_prefetch``, ``param_init_fn``,
  ``ignored_modules``, ``activation_checkpointing``, ``activation_checkpointing_offload``,
  ``cpu_ram_efficient_loading``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from accelkit.errors import ConfigurationError

__all__ = [
    "check_fsdp1_options",
    "cpu_offload_flag",
    "reshard_from_strategy",
    "state_dict_type_name",
    "strategy_name_or_none",
]

# The reference's numbering (1-based, as torch's enums).
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_STRATEGY_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
_STRATEGY_REFUSED = {
    "NO_SHARD": (
        "NO_SHARD replicates the whole model on every process, which is DDP: remove fsdp_plugin "
        "(and --use_fsdp) and the Accelerator wraps the model in DistributedDataParallel"
    ),
    "HYBRID_SHARD": "hybrid sharding needs a 2-D device mesh, which accelkit does not build",
    "HYBRID_SHARD_ZERO2": "hybrid sharding needs a 2-D device mesh, which accelkit does not build",
}
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")


def _name(value: Any, names: tuple[str, ...], what: str) -> str:
    """An enum member, its 1-based number or its name (any case) as the upper-case name."""
    member = getattr(value, "name", None)
    if isinstance(member, str):
        value = member
    elif isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= len(names):
            raise ConfigurationError(
                f"{what}={value}: expected 1 to {len(names)} or one of {names}."
            )
        return names[value - 1]
    text = str(value).strip().upper().lstrip("_")
    if text.isdigit():
        return _name(int(text), names, what)
    if text not in names:
        raise ConfigurationError(
            f"{what}={value!r} is unknown; expected one of {', '.join(names)}."
        )
    return text


def reshard_from_strategy(strategy: Any, reshard_after_forward: Any) -> Any:
    """``reshard_after_forward`` as ``sharding_strategy`` implies it (None: unchanged).

    Raises:
        ValueError: for a strategy without an FSDP2 counterpart, or one that contradicts an
            explicit ``reshard_after_forward``.
    """
    if strategy is None:
        return reshard_after_forward
    name = _name(strategy, _STRATEGIES, "sharding_strategy")
    if name in _STRATEGY_REFUSED:
        raise ConfigurationError(
            f"sharding_strategy={name!r} is not supported: {_STRATEGY_REFUSED[name]}. Use "
            "FULL_SHARD or SHARD_GRAD_OP (or reshard_after_forward=True/False)."
        )
    implied = _STRATEGY_RESHARD[name]
    if reshard_after_forward is not None and reshard_after_forward != implied:
        raise ConfigurationError(
            f"sharding_strategy={name!r} means reshard_after_forward={implied}, but "
            f"reshard_after_forward={reshard_after_forward!r} was given; pass only one of them."
        )
    return implied


def strategy_name_or_none(value: Any) -> str | None:
    """The sharding strategy ``value`` names (a member or a strategy string), else None."""
    member = getattr(value, "name", None)
    text = member if isinstance(member, str) else value
    if isinstance(text, str) and text.strip().upper().lstrip("_") in _STRATEGIES:
        return text.strip().upper().lstrip("_")
    return None


def state_dict_type_name(value: Any) -> str:
    """``state_dict_type`` as its name (``"SHARDED_STATE_DICT"``...).

    Raises:
        ValueError: for an unknown value, or ``LOCAL_STATE_DICT`` (FSDP1 only).
    """
    name = _name(value, _STATE_DICT_TYPES, "state_dict_type")
    if name == "LOCAL_STATE_DICT":
        raise ConfigurationError(
            "state_dict_type='LOCAL_STATE_DICT' is FSDP1-only (its flattened local shards); "
            "FSDP2 has no such state dict. Use SHARDED_STATE_DICT."
        )
    return name


def cpu_offload_flag(value: Any) -> Any:
    """FSDP1's ``CPUOffload(offload_params=...)`` as a bool; anything else unchanged."""
    if type(value).__name__ == "CPUOffload" and hasattr(value, "offload_params"):
        return bool(value.offload_params)
    return value


def _no_prefetch(value: Any) -> bool:
    return value is None or str(getattr(value, "name", value)).upper() == "NO_PREFETCH"


# option -> (is its value a no-op?, why FSDP2 has no such option)
_IGNORED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "backward_prefetch": (
        _no_prefetch,
        "FSDP2 prefetches the next unit's parameters in backward by itself",
    ),
    "use_orig_params": (
        lambda v: v is None or v is True,
        "FSDP2 always keeps the original parameters (as DTensors)",
    ),
    "sync_module_states": (
        lambda v: not v,
        "FSDP2 does not broadcast module states; build the model identically on every process "
        "(e.g. after set_seed) or load its weights on every process",
    ),
    "limit_all_gathers": (
        lambda v: v is True,
        "FSDP2 has no all-gather rate limiter",
    ),
}
# option -> why it is refused unless left at its default (None / False)
_REFUSED: dict[str, str] = {
    "forward_prefetch": "FSDP1-only: FSDP2's fully_shard has no forward prefetch setting",
    "param_init_fn": (
        "FSDP1-only: FSDP2 shards modules that already hold their parameters; create the model "
        "on a real device"
    ),
    "ignored_modules": "not supported by accelkit: every parameter of the model is sharded",
    "activation_checkpointing": (
        "not supported by accelkit's plugin: apply torch.utils.checkpoint in the model's forward"
    ),
    "activation_checkpointing_offload": (
        "not supported by accelkit's plugin: apply torch.utils.checkpoint in the model's forward"
    ),
    "cpu_ram_efficient_loading": (
        "not supported by accelkit: every process builds (or loads) the whole model before sharding"
    ),
}


def _check_state_dict_configs(values: dict[str, Any]) -> None:
    """Accept a ``FullStateDictConfig`` (``save_model``'s full state dict), warn about the
    rest of the state-dict configs, refuse what is not one (see the module docstring)."""
    from torch.distributed.fsdp import FullStateDictConfig, OptimStateDictConfig, StateDictConfig

    for option, kind in (
        ("state_dict_config", StateDictConfig),
        ("optim_state_dict_config", OptimStateDictConfig),
    ):
        value = values.get(option)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin({option}={value!r}) is not supported: expected "
                f"a torch.distributed.fsdp {kind.__name__} (e.g. FullStateDictConfig()) or None. "
                f"Remove {option}."
            )
        if isinstance(value, FullStateDictConfig):
            ignored = [f for f in ("offload_to_cpu", "rank0_only") if not getattr(value, f)]
            if ignored:
                warnings.warn(
                    f"FullyShardedDataParallelPlugin({option}={value!r}): "
                    f"{', '.join(f'{f}=False' for f in ignored)} is ignored: save_model gathers "
                    "the full state dict into CPU memory on the main process (as in "
                    "Accelerate's FSDP2 mode).",
                    stacklevel=5,
                )
            continue
        why = (
            "save_state writes sharded optimizer state through torch.distributed.checkpoint"
            if option == "optim_state_dict_config"
            else "save_state writes sharded state through torch.distributed.checkpoint and "
            "save_model one full state dict"
        )
        warnings.warn(
            f"FullyShardedDataParallelPlugin({option}={value!r}) is ignored: {why} (as in "
            "Accelerate's FSDP2 mode).",
            stacklevel=5,
        )


def check_fsdp1_options(values: dict[str, Any]) -> None:
    """Warn about FSDP1 options FSDP2 ignores; refuse those it cannot honour.

    Args:
        values: option name -> value, for the options of this module's tables.

    Raises:
        ValueError: naming the first refused option, its value and the reason.
    """
    _check_state_dict_configs(values)
    for option, why in _REFUSED.items():
        value = values.get(option)
        if value is not None and value is not False:
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin({option}={value!r}) is not supported: {why}. "
                f"Remove {option}."
            )
    for option, (is_noop, why) in _IGNORED.items():
        value = values.get(option)
        if not is_noop(value):
            warnings.warn(
                f"FullyShardedDataParallelPlugin({option}={value!r}) is ignored: {why} (as in "
                "Accelerate's FSDP2 mode).",
                stacklevel=4,
            )
