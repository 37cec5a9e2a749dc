"""The flags of ``accelkit launch``: every ``accelerate launch`` flag, accepted or refused.

Every flag is spelled as in the reference tool, with underscores or dashes (``--num_processes``,
``--num-processes``), and takes the reference's value spellings (``TRANSFORMER_BASED_WRAP``,
``true``/``false``, ``SHARDED_STATE_DICT``). A flag whose feature accelkit does not have is still
recognised, and refused with the reason (DeepSpeed, Megatron-LM, TPU/XLA and FP8 are out of
scope). A flag that only repeats what accelkit does anyway (``--dynamo_backend no``,
``--fsdp_use_orig_params true``) is accepted and has no effect.

Parsing leaves every flag that was not given as ``None``, so that a value from a config file
(:mod:`accelkit.launch.config`) fills only what the command line left open.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from accelkit._text import short
from accelkit.errors import ConfigurationError

__all__ = [
    "ACCEPTED",
    "REFUSED",
    "Setting",
    "add_launch_arguments",
    "check_refused",
    "explain_unknown",
    "parse_bool",
    "refusal_for",
    "settings_from_args",
]


@dataclass(frozen=True)
class Setting:
    """One launch setting and where it came from (for precedence and error messages)."""

    value: Any
    origin: str  # "--num_processes" or "config file /x.yaml, key 'num_processes'"


def parse_bool(value: Any, origin: str) -> bool:
    """``true/false/yes/no/1/0`` (any case) or a bool.

    Raises:
        ValueError: naming the origin and the accepted spellings.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{origin}: expected true or false, got {short(value)}.")


# The settings accelkit supports (flag names without the leading dashes).
ACCEPTED = frozenset(
    [
        "config_file",
        "cpu",
        "multi_gpu",
        "num_processes",
        "num_machines",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "same_network",
        "gpu_ids",
        "num_cpu_threads_per_process",
        "mixed_precision",
        "debug",
        "quiet",
        "module",
        "no_python",
        "max_restarts",
        "monitor_interval",
        "rdzv_backend",
        "rdzv_conf",
        "role",
        "tee",
        "log_dir",
        "use_fsdp",
        "fsdp_version",
        "fsdp_reshard_after_forward",
        "fsdp_sharding_strategy",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_min_num_params",
        "fsdp_offload_params",
        "fsdp_state_dict_type",
    ]
)


def _is_off(value: Any) -> bool:
    if isinstance(value, (list, tuple, dict)):
        return not value
    return value is None or value is False or str(value).strip().lower() in ("", "false", "no", "0")


@dataclass(frozen=True)
class _Refusal:
    why: str
    inert: Callable[[Any], bool] = _is_off  # values that ask for nothing: accepted, no effect


_DEEPSPEED = _Refusal(
    "DeepSpeed is not supported by accelkit; shard with --use_fsdp (FSDP2) instead."
)
_MEGATRON = _Refusal("Megatron-LM is not supported by accelkit (out of scope).")
_TPU = _Refusal("TPU/XLA execution is out of scope for accelkit; it runs on CPUs and GPUs.")
_FP8 = _Refusal("FP8 training is out of scope for accelkit; use --mixed_precision bf16 or fp16.")
_SAGEMAKER = _Refusal(
    "Launching on Amazon SageMaker is not supported; run accelkit launch on the machines."
)
_MPI = _Refusal(
    "Launching with mpirun is not supported; accelkit starts processes with torchrun: run "
    "accelkit launch on each machine with --num_machines/--machine_rank/--main_process_ip."
)
_PARALLELISM = _Refusal(
    "N-D parallelism (ParallelismConfig: tensor, context, sequence parallel) is not supported; "
    "--use_fsdp shards over all processes."
)
_DYNAMO = _Refusal(
    "The launcher does not compile the model; call torch.compile(model) in the script.",
    inert=lambda v: _is_off(v) or str(v).strip().lower() in ("no", "default"),
)
_AFFINITY = _Refusal(
    "CPU affinity is not set by accelkit launch; start it under numactl or taskset instead."
)
_FSDP1_PREFETCH = _Refusal(
    "FSDP1 prefetch policies do not exist in FSDP2 (fully_shard), which accelkit uses.",
    inert=lambda v: _is_off(v) or str(v).strip().upper() == "NO_PREFETCH",
)
_ACTIVATION_CKPT = _Refusal(
    "Activation checkpointing is not applied by the launcher; wrap the blocks with "
    "torch.utils.checkpoint in the model."
)
_ANYTHING = _Refusal("", inert=lambda v: True)

# Refused flags, by destination name (the flag is --<dest>). The option strings of the reference
# are registered, so a refused flag with a value does not swallow the script's name.
REFUSED: dict[str, _Refusal] = {
    **dict.fromkeys(
        [
            "use_deepspeed",
            "deepspeed_config_file",
            "zero_stage",
            "offload_optimizer_device",
            "offload_param_device",
            "offload_optimizer_nvme_path",
            "offload_param_nvme_path",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "zero3_init_flag",
            "zero3_save_16bit_model",
            "deepspeed_hostfile",
            "deepspeed_exclusion_filter",
            "deepspeed_inclusion_filter",
            "deepspeed_multinode_launcher",
            "deepspeed_moe_layer_cls_names",
        ],
        _DEEPSPEED,
    ),
    **dict.fromkeys(["tpu", "tpu_use_cluster", "tpu_use_sudo", "vm", "env"], _TPU),
    "downcast_bf16": _TPU,
    "main_training_function": _Refusal(_TPU.why, inert=lambda v: v in (None, "main")),
    **dict.fromkeys(["aws_access_key_id", "aws_secret_access_key"], _SAGEMAKER),
    "mpirun_hostfile": _MPI,
    "use_parallelism_config": _PARALLELISM,
    "use_megatron_lm": _MEGATRON,
    **dict.fromkeys(
        [
            "dynamo_backend",
            "dynamo_mode",
            "dynamo_use_fullgraph",
            "dynamo_use_dynamic",
            "dynamo_use_regional_compilation",
        ],
        _DYNAMO,
    ),
    "enable_cpu_affinity": _AFFINITY,
    "fsdp_backward_prefetch": _FSDP1_PREFETCH,
    "fsdp_forward_prefetch": _FSDP1_PREFETCH,
    "fsdp_activation_checkpointing": _ACTIVATION_CKPT,
    "fsdp_activation_checkpointing_offload": _ACTIVATION_CKPT,
    # FSDP2 always keeps the original parameters and needs no module-state sync; every process
    # builds and loads the model itself. Accepted with any value, no effect.
    "fsdp_use_orig_params": _ANYTHING,
    "fsdp_sync_module_states": _ANYTHING,
    "fsdp_cpu_ram_efficient_loading": _ANYTHING,
}
# Whole families of reference flags, present and future.
_REFUSED_PREFIXES = {
    "megatron_lm_": _MEGATRON,
    "fp8_": _FP8,
    "parallelism_config_": _PARALLELISM,
    "deepspeed_": _DEEPSPEED,
    "zero3_": _DEEPSPEED,
    "tpu_": _TPU,
    "dynamo_": _DYNAMO,
    "aws_": _SAGEMAKER,
    "mpirun_": _MPI,
}
_FLAG_VALUES = {  # refused reference flags that take a value (the others are switches)
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps",
    "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile",
    "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_multinode_launcher",
    "deepspeed_moe_layer_cls_names", "main_training_function", "aws_access_key_id",
    "aws_secret_access_key", "mpirun_hostfile", "dynamo_backend", "dynamo_mode",
    "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_activation_checkpointing",
    "fsdp_activation_checkpointing_offload", "fsdp_use_orig_params", "fsdp_sync_module_states",
    "fsdp_cpu_ram_efficient_loading",
}  # fmt: skip
_REFUSED_VALUE_FAMILIES = [
    "megatron_lm_tp_degree",
    "megatron_lm_pp_degree",
    "megatron_lm_num_micro_batches",
    "megatron_lm_sequence_parallelism",
    "megatron_lm_recompute_activations",
    "megatron_lm_use_distributed_optimizer",
    "megatron_lm_gradient_clipping",
    "megatron_lm_use_custom_fsdp",
    "megatron_lm_no_load_optim",
    "megatron_lm_eod_mask_loss",
    "megatron_lm_overlap_cpu_optimizer_d2h_h2d",
    "megatron_lm_no_save_optim",
    "megatron_lm_optimizer_cpu_offload",
    "megatron_lm_use_precision_aware_optimizer",
    "megatron_lm_decoder_last_pipeline_num_layers",
    "megatron_lm_recompute_granularity",
    "megatron_lm_recompute_method",
    "megatron_lm_recompute_num_layers",
    "megatron_lm_attention_backend",
    "megatron_lm_expert_model_parallel_size",
    "megatron_lm_context_parallel_size",
    "megatron_lm_attention_dropout",
    "megatron_lm_hidden_dropout",
    "megatron_lm_attention_softmax_in_fp32",
    "megatron_lm_expert_tensor_parallel_size",
    "megatron_lm_calculate_per_token_loss",
    "megatron_lm_use_rotary_position_embeddings",
    "fp8_backend",
    "fp8_margin",
    "fp8_interval",
    "fp8_format",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_override_linear_precision",
    "fp8_opt_level",
    "fp8_enable_fsdp_float8_all_gather",
    "fp8_pad_inner_dim",
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size",
    "parallelism_config_cp_size",
    "parallelism_config_cp_backend",
    "parallelism_config_cp_comm_strategy",
    "parallelism_config_sp_size",
    "parallelism_config_sp_backend",
    "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable",
    "parallelism_config_sp_attn_implementation",
]


def refusal_for(dest: str) -> _Refusal | None:
    """Why the reference setting ``dest`` is refused (None if accelkit supports it)."""
    if dest in REFUSED:
        return REFUSED[dest]
    for prefix, refusal in _REFUSED_PREFIXES.items():
        if dest.startswith(prefix):
            return refusal
    return None


def _spellings(dest: str) -> list[str]:
    names = [f"--{dest}"]
    if "_" in dest:
        names.append("--" + dest.replace("_", "-"))
    return names


class _Given(argparse.Action):
    """Stores the value (``const`` for a switch) and the spelling it was given with."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if self.nargs == 0:
            values = self.const
        elif self.dest in _APPENDED:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)
        if option_string is not None:
            origins = dict(getattr(namespace, _ORIGINS, None) or {})
            origins[self.dest] = option_string
            setattr(namespace, _ORIGINS, origins)


_ORIGINS = "_flag_spellings"
_APPENDED = {"vm", "env"}


def _add(group: Any, dest: str, *extra: str, **kwargs: Any) -> None:
    kwargs.setdefault("default", None)
    action = kwargs.pop("action", None)
    if action == "store_const":
        kwargs["nargs"] = 0
    else:
        kwargs.setdefault("metavar", "N" if kwargs.get("type") not in (None, float) else "VALUE")
    group.add_argument(*extra, *_spellings(dest), dest=dest, action=_Given, **kwargs)


def _int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _switch(group: Any, dest: str, *extra: str, help: str | None = None) -> None:
    _add(group, dest, *extra, action="store_const", const=True, help=help)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``accelkit launch`` flag to ``parser`` (all default to None: not given)."""
    g = parser.add_argument_group("Where and how many")
    _add(g, "config_file", metavar="FILE", help="an `accelerate config` YAML/JSON file "
         "(default: $HF_HOME/accelerate/default_config.yaml, read unless --cpu)")  # fmt: skip
    _switch(g, "cpu", help="run on CPU with gloo, even with GPUs")
    _switch(g, "multi_gpu", help="one process per GPU (default count: all GPUs)")
    _add(g, "num_processes", type=_int(1), help="total processes over all machines "
         "(default: GPUs on this machine, or 1)")  # fmt: skip
    _add(g, "num_machines", type=_int(1), help="machines taking part (default 1)")
    _add(g, "machine_rank", type=_int(0), help="this machine's rank, from 0 (default 0)")
    _add(g, "main_process_ip", help="address of machine 0 (default 127.0.0.1)")
    _add(g, "main_process_port", type=_int(0),
         help="port on machine 0 (default: free; 29500 over several machines)")  # fmt: skip
    _switch(g, "same_network", help="accepted; torchrun meets at machine 0 either way")
    _add(
        g, "gpu_ids", help="comma-separated GPU ids for this machine (CUDA_VISIBLE_DEVICES), or all"
    )
    _add(g, "num_cpu_threads_per_process", type=_int(1),
         help="OMP_NUM_THREADS of each process (default: cores / processes)")  # fmt: skip
    _add(g, "mixed_precision", help="no | fp16 | bf16")
    _switch(g, "debug", help="check collectives across processes (TORCH_DISTRIBUTED_DEBUG=DETAIL)")
    _switch(g, "quiet", "-q", help="only errors from torchrun's own logging")

    g = parser.add_argument_group("The script")
    _switch(g, "module", "-m", help="run the script as a module (python -m)")
    _switch(g, "no_python", help="run the script as an executable, without python")

    g = parser.add_argument_group("torchrun")
    _add(g, "max_restarts", type=_int(0), help="restart the workers this many times (default 0)")
    _add(g, "monitor_interval", type=float, help="seconds between checks of the workers")
    _add(g, "rdzv_backend", help="rendezvous backend: static (default) or c10d")
    _add(g, "rdzv_conf", help="rendezvous options key1=value1,key2=value2")
    _add(g, "role", help="user-defined role of the workers")
    _add(g, "tee", "-t", help="also write each worker's output to files (0-3, as torchrun)")
    _add(g, "log_dir", help="folder of torchrun's log files")

    g = parser.add_argument_group("FSDP2 (sharded data parallelism)")
    _switch(g, "use_fsdp", help="shard prepared models with FSDP2 (fully_shard)")
    _add(g, "fsdp_version", help="only 2 is supported")
    _add(g, "fsdp_reshard_after_forward", help="true | false | an integer")
    _add(g, "fsdp_sharding_strategy", help="FULL_SHARD (reshard after forward) | SHARD_GRAD_OP")
    _add(g, "fsdp_auto_wrap_policy", help="TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP")
    _add(g, "fsdp_transformer_layer_cls_to_wrap", help="comma-separated block class names")
    _add(g, "fsdp_min_num_params", type=_int(1), help="threshold of SIZE_BASED_WRAP")
    _add(g, "fsdp_offload_params", help="true | false")
    _add(g, "fsdp_state_dict_type", help="SHARDED_STATE_DICT (the only one save_state writes)")

    for dest in sorted({*REFUSED, *_REFUSED_VALUE_FAMILIES} - {"tpu_use_cluster"}):
        kwargs: dict[str, Any] = {"help": argparse.SUPPRESS}
        if dest in _FLAG_VALUES or dest in _APPENDED or dest in _REFUSED_VALUE_FAMILIES:
            kwargs["metavar"] = "VALUE"
        else:
            kwargs.update(action="store_const", const=True)
        _add(parser, dest, **kwargs)
    _add(parser, "tpu_use_cluster", "--tpu_cluster", "--tpu-cluster",
         action="store_const", const=True, help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--no_tpu_cluster", "--no-tpu-cluster", dest="tpu_use_cluster",
                        action=_Given, nargs=0, const=False, help=argparse.SUPPRESS)  # fmt: skip
    parser.epilog = (
        "Every `accelerate launch` flag is recognised. These are refused with the reason: "
        "DeepSpeed (--use_deepspeed, --zero_stage, --deepspeed_*, ...), Megatron-LM "
        "(--use_megatron_lm, --megatron_lm_*), TPU/XLA (--tpu, --tpu_*, ...), FP8 "
        "(--mixed_precision fp8, --fp8_*), SageMaker (--aws_*), --mpirun_hostfile, "
        "--use_parallelism_config/--parallelism_config_*, torch.compile (--dynamo_*), "
        "--enable_cpu_affinity. Stopping: SIGTERM or Ctrl-C stops every worker (SIGTERM), "
        "waits up to 40 s, and exits with 128 + signal; if the launcher itself is killed (even "
        "with SIGKILL), torchrun and every worker are killed with it."
    )
    # Optional to argparse so that a launch without a script gets our message (what is missing,
    # with an example) from config_from_args, not argparse's "script, script_args are required".
    parser.add_argument("script", nargs="?", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")


_NOT_SETTINGS = {"script", "script_args", "func", "command", "_parser", _ORIGINS}


def settings_from_args(args: argparse.Namespace) -> dict[str, Setting]:
    """The flags given on the command line, each with its flag as origin."""
    spellings = getattr(args, _ORIGINS, None) or {}
    return {
        dest: Setting(value, spellings.get(dest, _spellings(dest)[0]))
        for dest, value in vars(args).items()
        if value is not None and dest not in _NOT_SETTINGS
    }


def check_refused(settings: dict[str, Setting]) -> None:
    """Refuse the settings accelkit does not support, naming the first one and why.

    Raises:
        ValueError: ``"--zero_stage: DeepSpeed is not supported by accelkit; ..."``.
    """
    for dest, setting in settings.items():
        refusal = refusal_for(dest)
        if refusal is not None and not refusal.inert(setting.value):
            given = "" if setting.value is True else f" ({short(setting.value)})"
            raise ConfigurationError(f"{setting.origin}{given}: {refusal.why}")


def explain_unknown(flags: Iterable[str], known: Iterable[str], *, refusals: bool = True) -> str:
    """The error for unrecognised flags: the reason for a refused family, or the nearest flag.

    Args:
        flags: the unrecognised arguments, as typed.
        known: the option strings of the parser that refused them.
        refusals: whether to explain flags of `accelerate launch` that accelkit refuses (only
            for ``accelkit launch``; other commands just suggest the nearest of ``known``).
    """
    known = list(known)
    parts = []
    for flag in flags:
        dest = flag.split("=", 1)[0].lstrip("-").replace("-", "_")
        refusal = refusal_for(dest) if refusals and flag.startswith("--") else None
        if refusal is not None:
            parts.append(f"{flag}: {refusal.why}")
            continue
        close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        parts.append(f"unrecognized argument {flag}{hint}")
    return "; ".join(parts)
