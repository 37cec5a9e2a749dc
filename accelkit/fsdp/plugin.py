"""The options of FSDP2 sharding: :class:`FullyShardedDataParallelPlugin` and its launch flags.

The plugin only describes; :mod:`accelkit.fsdp.runtime` applies it. ``accelkit launch --use_fsdp
--fsdp_...`` turns flags into ``ACCELKIT_FSDP_*`` environment variables
(:func:`add_launch_arguments`, :func:`launch_env`), which
:meth:`FullyShardedDataParallelPlugin.from_env` reads back in every worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.fsdp.fsdp1_options import (
    check_fsdp1_options,
    cpu_offload_flag,
    reshard_from_strategy,
    state_dict_type_name,
    strategy_name_or_none,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "AUTO_WRAP_POLICIES",
    "ENV_USE_FSDP",
    "STATE_DICT_TYPES",
    "FullyShardedDataParallelPlugin",
    "add_launch_arguments",
    "fully_shard_function",
    "launch_env",
    "plugin_from_env_or",
]

AUTO_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT",)
_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
    "no": None,
}
ENV_USE_FSDP = "ACCELKIT_USE_FSDP"
_ENV_PREFIX = "ACCELKIT_FSDP_"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _dtype(value: Any, what: str) -> torch.dtype | None:
    import torch

    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).strip().lower()
    if key not in _DTYPES:
        raise ConfigurationError(
            f"{what}={value!r} is not a dtype; expected a torch.dtype or one of "
            f"{', '.join(sorted(_DTYPES))}."
        )
    name = _DTYPES[key]
    return None if name is None else getattr(torch, name)


def _torch_lacks(option: str) -> ValueError:
    return ValueError(
        f"FSDP option {option!r} is not available in this torch ({_torch_version()}): "
        f"torch.distributed.fsdp.fully_shard does not accept it. Upgrade torch, or remove "
        f"{option!r} from FullyShardedDataParallelPlugin(...)."
    )


def fully_shard_function() -> Callable[..., Any]:
    """``torch.distributed.fsdp.fully_shard``, or a ValueError naming the torch needed."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise ConfigurationError(
            f"This torch ({_torch_version()}) has no torch.distributed.fsdp.fully_shard "
            "(FSDP2); accelkit's fsdp_plugin needs torch >= 2.6."
        ) from None
    return fully_shard


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """Options for sharding models with FSDP2 (``Accelerator(fsdp_plugin=...)``).

    The parameters are Accelerate's, in its order; its FSDP1 options are translated to FSDP2
    where they have a meaning there, ignored with a warning where Accelerate's FSDP2 mode
    ignores them, and refused by name otherwise (see :mod:`accelkit.fsdp.fsdp1_options`).

    Args:
        fsdp_version: only ``2`` (``fully_shard``; None means 2); the wrapper-class FSDP1 is
            not offered.
        sharding_strategy: FSDP1's strategy as an FSDP2 setting: ``"FULL_SHARD"`` is
            ``reshard_after_forward=True``, ``"SHARD_GRAD_OP"`` is ``False`` (names,
            ``ShardingStrategy`` members or their numbers). ``NO_SHARD`` (DDP) and the hybrid
            strategies are refused.
        reshard_after_forward: free the gathered parameters after forward (``True``, less
            memory), keep them until backward (``False``, less communication), or reshard to
            an ``int`` smaller group. Default: True (or what ``sharding_strategy`` implies).
        backward_prefetch: FSDP1-only; ignored with a warning (FSDP2 prefetches itself).
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of
            its fields (dtypes may be strings such as ``"bf16"``), or ``"bf16"``/``"fp16"``. When
            None, ``Accelerator(mixed_precision="bf16"|"fp16")`` gives parameters in that dtype
            and gradient reduction in float32.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory
            (``True``, a ``CPUOffloadPolicy``, or FSDP1's ``CPUOffload``). Only meaningful on
            an accelerator device; on a CPU run it is ignored with a warning (everything is in
            CPU memory already).
        auto_wrap_policy: which sub-modules get their own ``fully_shard`` unit (the root always
            does): ``"transformer_based_wrap"`` (classes named in
            ``transformer_cls_names_to_wrap``), ``"size_based_wrap"`` (modules with at least
            ``min_num_params`` parameters of their own), ``"no_wrap"``, or a callable
            ``module -> bool``. Default: inferred from the two options below, else ``"no_wrap"``.
        ignored_modules: only None (not supported).
        state_dict_type: how ``save_state`` writes sharded models: only
            ``"SHARDED_STATE_DICT"`` (every process writes its shards through
            ``torch.distributed.checkpoint``); a consolidated model is written by
            ``save_model``. Names, ``StateDictType`` members or their numbers.
        state_dict_config: None, or a ``FullStateDictConfig`` (what ``save_model`` writes:
            one full state dict); other torch state-dict configs are ignored with a warning.
        optim_state_dict_config: ignored with a warning (``save_state`` writes sharded
            optimizer state).
        limit_all_gathers: FSDP1-only; False is ignored with a warning.
        use_orig_params: FSDP1-only; False is ignored with a warning (FSDP2 always does).
        param_init_fn: FSDP1-only; only None.
        sync_module_states: FSDP1-only; True is ignored with a warning (build the model
            identically on every process).
        forward_prefetch: FSDP1-only; only None/False.
        activation_checkpointing: only None/False (not supported).
        activation_checkpointing_offload: only None/False (not supported).
        cpu_ram_efficient_loading: only None/False (not supported).
        transformer_cls_names_to_wrap: class names of the blocks to shard separately, e.g.
            ``["TransformerBlock"]``.
        min_num_params: parameter-count threshold of ``"size_based_wrap"``.
        fully_shard_kwargs: further ``fully_shard`` keyword arguments, checked against this
            torch's signature.

    Raises:
        ValueError: for an unknown option value, naming it and the accepted values.

    Example:
        >>> plugin = FullyShardedDataParallelPlugin(
        ...     auto_wrap_policy="transformer_based_wrap",
        ...     transformer_cls_names_to_wrap=["Block"],
        ... )
        >>> accelerator = Accelerator(fsdp_plugin=plugin)
    """

    # Accelerate's parameters in Accelerate's order (so positional arguments bind the same
    # way), then accelkit's own.
    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: bool | int | str | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable[[nn.Module], bool] | None = None
    cpu_offload: Any = False
    ignored_modules: Any = None
    state_dict_type: Any = "SHARDED_STATE_DICT"
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: Sequence[str] | None = None
    min_num_params: int | None = None
    fully_shard_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fsdp_version is None:
            self.fsdp_version = 2
        if self.fsdp_version != 2:
            raise ConfigurationError(
                f"fsdp_version={self.fsdp_version!r} is not supported: accelkit shards with "
                "FSDP2 (torch.distributed.fsdp.fully_shard). Use fsdp_version=2."
            )
        check_fsdp1_options({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        strategy = strategy_name_or_none(self.reshard_after_forward)
        if strategy is not None:  # the reference's FSDP1 spelling, e.g. "FULL_SHARD"
            self.reshard_after_forward = reshard_from_strategy(strategy, None)
        elif isinstance(self.reshard_after_forward, str):
            self.reshard_after_forward = _parse_reshard(self.reshard_after_forward)
        self.reshard_after_forward = reshard_from_strategy(
            self.sharding_strategy, self.reshard_after_forward
        )
        if self.reshard_after_forward is None:
            self.reshard_after_forward = True
        self.cpu_offload = cpu_offload_flag(self.cpu_offload)
        self.state_dict_type = state_dict_type_name(self.state_dict_type)
        if isinstance(self.auto_wrap_policy, str):
            self.auto_wrap_policy = self.auto_wrap_policy.lower()
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                n.strip() for n in self.transformer_cls_names_to_wrap.split(",") if n.strip()
            ]
        if self.auto_wrap_policy is None:
            if self.transformer_cls_names_to_wrap:
                self.auto_wrap_policy = "transformer_based_wrap"
            elif self.min_num_params:
                self.auto_wrap_policy = "size_based_wrap"
            else:
                self.auto_wrap_policy = "no_wrap"
        policy = self.auto_wrap_policy
        if isinstance(policy, str):
            if policy not in AUTO_WRAP_POLICIES:
                raise ConfigurationError(
                    f"auto_wrap_policy={policy!r} is unknown; expected one of "
                    f"{', '.join(AUTO_WRAP_POLICIES)} or a callable module -> bool."
                )
            if policy == "transformer_based_wrap" and not self.transformer_cls_names_to_wrap:
                raise ConfigurationError(
                    "auto_wrap_policy='transformer_based_wrap' needs "
                    "transformer_cls_names_to_wrap=[<block class names>]."
                )
            if policy == "size_based_wrap" and not (
                isinstance(self.min_num_params, int) and self.min_num_params > 0
            ):
                raise ConfigurationError(
                    f"auto_wrap_policy='size_based_wrap' needs min_num_params=<int > 0>, got "
                    f"{self.min_num_params!r}."
                )
        elif not callable(policy):
            raise ConfigurationError(
                f"auto_wrap_policy must be a string or callable, got {policy!r}."
            )
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ConfigurationError(
                f"state_dict_type={self.state_dict_type!r} is not supported; save_state writes "
                f"{STATE_DICT_TYPES[0]} (resumable on any process count). For one consolidated "
                "model file use accelerator.save_model(model, folder)."
            )

    # --------------------------------------------------------------- launcher

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FullyShardedDataParallelPlugin:
        """The plugin ``accelkit launch --use_fsdp --fsdp_...`` described to this worker."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        for option, convert in _LAUNCH_OPTIONS.items():
            raw = env.get(_ENV_PREFIX + option.upper())
            if raw not in (None, ""):
                kwargs[option] = convert(raw)
        return cls(**kwargs)

    # ------------------------------------------------------------ fully_shard

    def fully_shard_kwargs_for(self, device: torch.device, mixed_precision: str) -> dict[str, Any]:
        """The keyword arguments (besides ``mesh``) every ``fully_shard`` call receives.

        Raises:
            ValueError: for an option this torch's ``fully_shard`` lacks.
        """
        accepted = set(inspect.signature(fully_shard_function()).parameters)
        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        policy = self._mp_policy(mixed_precision)
        if policy is not None:
            kwargs["mp_policy"] = policy
        offload = self._offload_policy(device)
        if offload is not None:
            kwargs["offload_policy"] = offload
        kwargs.update(self.fully_shard_kwargs)
        for option in kwargs:
            if option not in accepted:
                raise _torch_lacks(option)
        return kwargs

    def _mp_policy(self, mixed_precision: str) -> Any:
        policy = self.mixed_precision_policy
        if policy is None and mixed_precision in ("bf16", "fp16"):
            policy = {"param_dtype": mixed_precision, "reduce_dtype": "fp32"}
        if policy is None:
            return None
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:
            raise _torch_lacks("mixed_precision_policy") from None
        if isinstance(policy, MixedPrecisionPolicy):
            return policy
        if isinstance(policy, str):
            policy = {"param_dtype": policy, "reduce_dtype": "fp32"}
        if not isinstance(policy, dict):
            raise ConfigurationError(
                f"mixed_precision_policy={policy!r}: expected a MixedPrecisionPolicy, a dict of "
                "its fields, or 'bf16'/'fp16'."
            )
        fields = set(inspect.signature(MixedPrecisionPolicy).parameters)
        args: dict[str, Any] = {}
        for key, value in policy.items():
            if key not in fields:
                raise _torch_lacks(f"mixed_precision_policy.{key}")
            args[key] = _dtype(value, key) if key.endswith("_dtype") else value
        return MixedPrecisionPolicy(**args)

    def _offload_policy(self, device: torch.device) -> Any:
        offload = self.cpu_offload
        if offload is False or offload is None:
            return None
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy
        except ImportError:
            raise _torch_lacks("cpu_offload") from None
        if device.type == "cpu":
            warnings.warn(
                "FullyShardedDataParallelPlugin(cpu_offload=...) is ignored on a CPU run: the "
                "parameters are in CPU memory already.",
                stacklevel=3,
            )
            return None
        if offload is True:
            return CPUOffloadPolicy()
        if isinstance(offload, CPUOffloadPolicy):
            return offload
        raise ConfigurationError(f"cpu_offload={offload!r}: expected a bool or a CPUOffloadPolicy.")

    def wraps(self, module: nn.Module, own_params: int) -> bool:
        """Whether ``module`` (not the root) gets its own ``fully_shard`` unit.

        Args:
            module: a sub-module.
            own_params: parameters under it not already in a wrapped descendant.
        """
        policy = self.auto_wrap_policy
        if callable(policy):
            return bool(policy(module))
        if policy == "transformer_based_wrap":
            return type(module).__name__ in (self.transformer_cls_names_to_wrap or ())
        if policy == "size_based_wrap":
            return own_params >= (self.min_num_params or 0)
        return False


def _parse_reshard(text: str) -> bool | int:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "full_shard"):
        return True
    if low in ("false", "0", "no", "shard_grad_op"):
        return False
    try:
        return int(low)
    except ValueError:
        raise ConfigurationError(
            f"reshard_after_forward={text!r}: expected true, false or an integer."
        ) from None


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


_LAUNCH_OPTIONS: dict[str, Callable[[str], Any]] = {
    "reshard_after_forward": _parse_reshard,
    "auto_wrap_policy": str,
    "transformer_cls_names_to_wrap": lambda s: [n.strip() for n in s.split(",") if n.strip()],
    "min_num_params": int,
    "cpu_offload": _parse_bool,
    "mixed_precision_policy": str,
    "state_dict_type": str,
}


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--use_fsdp`` and the ``--fsdp_*`` flags to ``accelkit launch``."""
    group = parser.add_argument_group("FSDP2 (sharded data parallelism)")
    group.add_argument("--use_fsdp", action="store_true", help="shard prepared models (FSDP2)")
    group.add_argument("--fsdp_version", type=int, default=None, help="only 2 is supported")
    group.add_argument("--fsdp_reshard_after_forward", default=None, help="true | false | int")
    group.add_argument("--fsdp_auto_wrap_policy", default=None, choices=AUTO_WRAP_POLICIES)
    group.add_argument(
        "--fsdp_transformer_layer_cls_to_wrap", default=None, help="comma-separated class names"
    )
    group.add_argument("--fsdp_min_num_params", type=int, default=None)
    group.add_argument("--fsdp_offload_params", default=None, help="true | false")
    group.add_argument("--fsdp_state_dict_type", default=None, choices=STATE_DICT_TYPES)


def launch_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment variables for the workers from the ``--fsdp_*`` flags (empty without FSDP).

    Raises:
        ValueError: for ``--fsdp_version`` other than 2.
    """
    if not getattr(args, "use_fsdp", False):
        return {}
    if args.fsdp_version not in (None, 2):
        raise ConfigurationError(
            f"--fsdp_version {args.fsdp_version}: accelkit supports only FSDP2 (2)."
        )
    env = {ENV_USE_FSDP: "1"}
    flags = {
        "reshard_after_forward": args.fsdp_reshard_after_forward,
        "auto_wrap_policy": args.fsdp_auto_wrap_policy,
        "transformer_cls_names_to_wrap": args.fsdp_transformer_layer_cls_to_wrap,
        "min_num_params": args.fsdp_min_num_params,
        "cpu_offload": args.fsdp_offload_params,
        "state_dict_type": args.fsdp_state_dict_type,
    }
    for option, value in flags.items():
        if value is not None:
            env[_ENV_PREFIX + option.upper()] = str(value)
    return env


def plugin_from_env_or(plugin: Any) -> FullyShardedDataParallelPlugin | None:
    """``plugin`` if given (validated), else the launcher's plugin when ``--use_fsdp`` was set.

    Raises:
        TypeError: if ``plugin`` is not a :class:`FullyShardedDataParallelPlugin`.
    """
    if plugin is None:
        flag = os.environ.get(ENV_USE_FSDP, "")
        return FullyShardedDataParallelPlugin.from_env() if _parse_bool(flag or "0") else None
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise WrongTypeError(
            f"fsdp_plugin must be an accelkit FullyShardedDataParallelPlugin, got "
            f"{type(plugin).__name__}."
        )
    return plugin
