"""``accelkit config``: write the config file ``accelkit launch`` (and ``accelerate launch``) reads.

``accelkit config`` asks a few questions; ``accelkit config default`` writes, without asking, the
settings for this machine (every GPU, or one CPU process). Both write the reference tool's format
to its default place (``$HF_HOME/accelerate/default_config.yaml``) unless ``--config_file`` says
otherwise, and neither overwrites an existing file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from accelkit._text import escape
from accelkit.errors import ConfigurationError
from accelkit.launch.config import default_config_path, default_settings, write_config_file

_PRECISIONS = ("no", "fp16", "bf16")
_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")


def register(subparsers: Any) -> None:
    """Add the ``config`` subcommand and its ``default`` form."""
    parser = subparsers.add_parser(
        "config",
        help="write a launch config file (questions, or `config default` for this machine)",
        description=(
            "Ask how to launch and write the answers as an `accelerate config` file, read by "
            "accelkit launch (and accelerate launch) when no flag says otherwise."
        ),
        allow_abbrev=False,
    )
    _add_path(parser)
    parser.set_defaults(func=_run_questions, _parser=parser)
    sub = parser.add_subparsers(dest="config_command", metavar="{default}")
    default = sub.add_parser(
        "default",
        help="write the settings for this machine without asking",
        description="Write a config file for this machine: all its GPUs, or one CPU process.",
        allow_abbrev=False,
    )
    _add_path(default)
    default.add_argument(
        "--mixed_precision", "--mixed-precision", choices=_PRECISIONS, default="no"
    )
    default.set_defaults(func=_run_default, _parser=default)


def _add_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config_file",
        "--config-file",
        default=None,
        metavar="FILE",
        help=f"where to write (default: {default_config_path()})",
    )


def _write(path: str | None, settings: dict[str, Any]) -> int:
    target = path or default_config_path()
    try:
        write_config_file(target, settings)
    except FileExistsError:
        print(
            f"accelkit config: error: {target} exists; not overwriting it. Remove it, or pass "
            "another --config_file.",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        where = exc.filename or target
        print(
            f"accelkit config: error: cannot write {target}: {exc.strerror} ({where}). Pass "
            "--config_file with a path in a folder you can write.",
            file=sys.stderr,
        )
        return 1
    print(f"accelkit configuration saved at {target}")
    return 0


def _run_default(args: argparse.Namespace) -> int:
    return _write(args.config_file, default_settings(args.mixed_precision))


# The questions that took their default because stdin had no answer left (a pipe or file that
# ended, /dev/null): `accelkit config` names them after writing, so nobody mistakes the file for
# the answers they meant to give.
_unanswered: list[tuple[str, Any]] = []


def _ask(
    question: str, default: Any, convert: Callable[[str], Any] = str, choices: Sequence[Any] = ()
) -> Any:
    hint = f" ({'/'.join(map(str, choices))})" if choices else ""
    while True:
        try:
            answer = input(f"{question}{hint} [{default}]: ").strip()
        except EOFError:
            _unanswered.append((question, default))
            return default
        if not answer:
            return default
        try:
            value = convert(answer)
        except ValueError:
            print(f"  {answer!r} is not valid here; try again.")
            continue
        if choices and value not in choices:
            print(f"  choose one of {', '.join(map(str, choices))}.")
            continue
        return value


def _yes(text: str) -> bool:
    low = text.lower()
    if low in ("y", "yes", "true", "1"):
        return True
    if low in ("n", "no", "false", "0"):
        return False
    raise ConfigurationError(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ConfigurationError(text)
    return value


def _rank(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ConfigurationError(text)
    return value


def ask_settings() -> dict[str, Any]:
    """Ask the questions of ``accelkit config`` on stdin; return the settings to write."""
    settings = default_settings(gpus=0)
    kind = _ask("How will the script run", "NO", str.upper, _TYPES)
    settings["distributed_type"] = kind
    settings["use_cpu"] = kind == "MULTI_CPU" or (kind == "NO" and _ask("On CPU only", True, _yes))
    if kind != "NO":
        machines = _ask("How many machines", 1, _positive)
        settings["num_machines"] = machines
        if machines > 1:
            settings["machine_rank"] = _ask("Rank of this machine", 0, _rank)
            settings["main_process_ip"] = _ask("IP address of machine 0", "127.0.0.1")
            settings["main_process_port"] = _ask("Port on machine 0", 29500, _positive)
        settings["num_processes"] = _ask("Processes in total, over all machines", 2, _positive)
        if kind in ("MULTI_GPU", "FSDP"):
            settings["gpu_ids"] = _ask("GPU ids to use on this machine", "all")
    settings["mixed_precision"] = _ask("Mixed precision", "no", str.lower, _PRECISIONS)
    if kind == "FSDP":
        fsdp: dict[str, Any] = {"fsdp_version": 2}
        policies = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
        policy = _ask("Auto wrap policy", "TRANSFORMER_BASED_WRAP", str.upper, policies)
        fsdp["fsdp_auto_wrap_policy"] = policy
        if policy == "TRANSFORMER_BASED_WRAP":
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = _ask("Block class names (a,b)", "")
        elif policy == "SIZE_BASED_WRAP":
            fsdp["fsdp_min_num_params"] = _ask("Minimum parameters per unit", 100000000, int)
        fsdp["fsdp_reshard_after_forward"] = _ask("Reshard after forward", True, _yes)
        fsdp["fsdp_offload_params"] = _ask("Offload parameters to CPU", False, _yes)
        fsdp["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
        settings["fsdp_config"] = fsdp
    return settings


def _run_questions(args: argparse.Namespace) -> int:
    _unanswered.clear()
    code = _write(args.config_file, ask_settings())
    if _unanswered and code == 0:
        # Without a terminal the prompts went nowhere anyone reads: say, on stderr and on a
        # line of its own, which answers are defaults and where they went.
        target = escape(args.config_file or default_config_path())
        taken = "; ".join(f"{question}: {default}" for question, default in _unanswered)
        print(
            f"\naccelkit config: stdin had no answer for {len(_unanswered)} question(s) (it is "
            f"not a terminal, or ended), so they took their defaults ({taken}); wrote "
            f"{target}. Run `accelkit config` in a terminal to choose, `accelkit config "
            "default` for this machine's settings, or edit the file.",
            file=sys.stderr,
        )
    return code
