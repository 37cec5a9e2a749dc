"""Starting processes: ``accelkit launch`` and :func:`notebook_launcher`.

accelkit writes no process manager of its own. ``accelkit launch`` translates the flags users know
from the reference tool into a ``torch.distributed.run`` (torchrun) invocation, and
:func:`notebook_launcher` (in :mod:`accelkit.launch.notebook`, re-exported here) uses torch's
elastic launcher.

The flags live in :mod:`accelkit.launch.flags`, config files in :mod:`accelkit.launch.config`, and
how a signal stops the job in :mod:`accelkit.launch.signals`; this module merges flags over the
config file into a :class:`LaunchConfig` and runs it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelkit._text import clip, short
from accelkit.errors import ConfigurationError
from accelkit.fsdp.plugin import (
    AUTO_WRAP_POLICIES,
    STATE_DICT_TYPES,
    FullyShardedDataParallelPlugin,
)
from accelkit.fsdp.plugin import launch_env as fsdp_launch_env
from accelkit.launch._failure import (
    ENV_ERROR_FILE,
    ENV_FAILURE_FILE,
    Failure,
    failure_line,
    read_error_file,
    read_failure,
)
from accelkit.launch.config import default_config_path, read_config_file
from accelkit.launch.flags import (
    ACCEPTED,
    Setting,
    add_launch_arguments,
    check_refused,
    parse_bool,
    refusal_for,
    settings_from_args,
)
from accelkit.launch.job_memory import JobMemory
from accelkit.launch.notebook import notebook_launcher
from accelkit.launch.signals import guarded_command, run_child
from accelkit.runtime.environment import ENV_MIXED_PRECISION, ENV_USE_CPU, parse_mixed_precision
from accelkit.runtime.job_memory import ENV_MEMORY_DIR
from accelkit.runtime.preemption import (
    ENV_PREEMPTION_FILE,
    ENV_PREEMPTION_JOB,
    read_exit_record,
)

__all__ = [
    "LaunchConfig",
    "add_launch_arguments",
    "config_from_args",
    "launch_command",
    "notebook_launcher",
    "torchrun_args",
]


@dataclass(frozen=True)
class LaunchConfig:
    """The validated settings of one ``accelkit launch`` call."""

    script: str
    script_args: tuple[str, ...]
    num_processes: int
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str = "127.0.0.1"
    main_process_port: int = 29500
    mixed_precision: str = "no"
    cpu: bool = False
    module: bool = False
    no_python: bool = False
    max_restarts: int = 0
    extra_env: tuple[tuple[str, str], ...] = ()
    torchrun_options: tuple[str, ...] = ()

    @property
    def nproc_per_node(self) -> int:
        """Processes started on this machine."""
        return self.num_processes // self.num_machines


# torchrun options given through as they are: (flag of accelkit launch, torchrun's flag).
_TORCHRUN_OPTIONS = {
    "monitor_interval": "--monitor-interval",
    "rdzv_conf": "--rdzv-conf",
    "role": "--role",
    "tee": "--tee",
    "log_dir": "--log-dir",
}


# No count, rank or port of a launch comes near this; a larger number is a mistake.
_MAX_INTEGER = 2**31 - 1
_MAX_LOCAL_PROCESSES = 4096


class _Settings:
    """Merged settings with typed getters whose errors name where a bad value came from."""

    def __init__(self, settings: dict[str, Setting]) -> None:
        self.settings = settings

    def raw(self, name: str) -> Any:
        setting = self.settings.get(name)
        return None if setting is None else setting.value

    def origin(self, name: str) -> str:
        return self.settings[name].origin

    def flag(self, name: str) -> bool:
        value = self.raw(name)
        return False if value is None else parse_bool(value, self.origin(name))

    def integer(self, name: str, minimum: int) -> int | None:
        value = self.raw(name)
        if value is None:
            return None
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: YAML's .inf
            raise ConfigurationError(
                f"{self.origin(name)}: expected an integer, got {short(value)}."
            ) from None
        if number > _MAX_INTEGER:
            raise ConfigurationError(
                f"{self.origin(name)}: must be <= {_MAX_INTEGER}, got {short(number)}."
            )
        if number < minimum:
            raise ConfigurationError(f"{self.origin(name)}: must be >= {minimum}, got {number}.")
        return number


def _merged_settings(args: argparse.Namespace) -> _Settings:
    """Command-line flags over the config file's settings (see :mod:`accelkit.launch.config`)."""
    cli = settings_from_args(args)
    path = cli.pop("config_file").value if "config_file" in cli else None
    if path is None and "cpu" not in cli and os.path.isfile(default_config_path()):
        path = default_config_path()
    settings: dict[str, Setting] = {}
    if path is not None:
        from_file = read_config_file(path)
        if any(mode in cli for mode in ("multi_gpu", "use_fsdp")):
            # A mode chosen on the command line replaces the file's distributed_type.
            for mode in ("multi_gpu", "use_fsdp"):
                if mode in from_file and from_file[mode].origin.endswith("distributed_type"):
                    del from_file[mode]
        settings.update(from_file)
    settings.update(cli)
    for name, setting in settings.items():
        if name not in ACCEPTED and refusal_for(name) is None:
            raise ConfigurationError(f"{setting.origin} is not a setting of `accelerate launch`.")
    check_refused(settings)
    return _Settings(settings)


def _mixed_precision(s: _Settings) -> str:
    value = s.raw("mixed_precision")
    if value is None:
        return parse_mixed_precision(None).value
    if value is False:  # YAML 1.1 reads an unquoted `no` as false
        value = "no"
    if not isinstance(value, str) or len(value) > 16:
        raise ConfigurationError(
            f"{s.origin('mixed_precision')} ({short(value)}): expected no, fp16 or bf16."
        )
    if str(value).strip().lower() == "fp8":
        raise ConfigurationError(
            f"{s.origin('mixed_precision')} ('fp8'): FP8 training is out of scope for accelkit; "
            "use bf16 or fp16."
        )
    try:
        return parse_mixed_precision(str(value)).value
    except ValueError as exc:
        raise ConfigurationError(f"{s.origin('mixed_precision')}: {exc}") from None


def _gpu_ids(s: _Settings) -> list[str] | None:
    value = s.raw("gpu_ids")
    if value is None or str(value).strip().lower() == "all":
        return None
    ids = [part.strip() for part in str(value).split(",") if part.strip()]
    if not ids or not all(part.isdigit() for part in ids):
        raise ConfigurationError(
            f"{s.origin('gpu_ids')} ({short(value)}): expected comma-separated GPU numbers such as "
            "0,1 or 'all'."
        )
    return ids


def _fsdp_env(s: _Settings) -> dict[str, str]:
    """``ACCELKIT_FSDP_*`` variables from the ``--fsdp_*`` settings, validated by the plugin."""
    if not s.flag("use_fsdp"):
        return {}
    version = s.integer("fsdp_version", 1)
    if version not in (None, 2):
        raise ConfigurationError(
            f"{s.origin('fsdp_version')} ({version}): accelkit shards with FSDP2 "
            "(torch.distributed.fsdp.fully_shard); use --fsdp_version 2."
        )
    reshard = s.raw("fsdp_reshard_after_forward")
    strategy = s.raw("fsdp_sharding_strategy")
    if reshard is None and strategy is not None:
        # FSDP1's strategies, as the reference maps them onto FSDP2.
        mapped = {"FULL_SHARD": "true", "1": "true", "SHARD_GRAD_OP": "false", "2": "false"}
        reshard = mapped.get(str(strategy).strip().upper())
        if reshard is None:
            raise ConfigurationError(
                f"{s.origin('fsdp_sharding_strategy')} ({short(strategy)}): FSDP2 offers "
                "FULL_SHARD (1) and SHARD_GRAD_OP (2); NO_SHARD is plain DDP (drop --use_fsdp) "
                "and hybrid sharding is not supported."
            )
    policy = s.raw("fsdp_auto_wrap_policy")
    if policy is not None:
        policy = str(policy).strip().lower()
        if policy not in AUTO_WRAP_POLICIES:
            raise ConfigurationError(
                f"{s.origin('fsdp_auto_wrap_policy')} ({short(s.raw('fsdp_auto_wrap_policy'))}): "
                f"expected one of {', '.join(p.upper() for p in AUTO_WRAP_POLICIES)}."
            )
    state_dict = s.raw("fsdp_state_dict_type")
    if state_dict is not None and str(state_dict).strip().upper() not in STATE_DICT_TYPES:
        raise ConfigurationError(
            f"{s.origin('fsdp_state_dict_type')} ({short(state_dict)}): save_state writes "
            f"{STATE_DICT_TYPES[0]} (resumable on any process count); for one consolidated "
            "model file call accelerator.save_model(model, folder)."
        )
    offload = s.raw("fsdp_offload_params")
    env = fsdp_launch_env(
        argparse.Namespace(
            use_fsdp=True,
            fsdp_version=version,
            fsdp_reshard_after_forward=None if reshard is None else str(reshard).lower(),
            fsdp_auto_wrap_policy=policy,
            fsdp_transformer_layer_cls_to_wrap=s.raw("fsdp_transformer_layer_cls_to_wrap"),
            fsdp_min_num_params=s.integer("fsdp_min_num_params", 1),
            fsdp_offload_params=None
            if offload is None
            else str(s.flag("fsdp_offload_params")).lower(),
            fsdp_state_dict_type=None if state_dict is None else str(state_dict).strip().upper(),
        )
    )
    try:
        FullyShardedDataParallelPlugin.from_env(env)
    except ValueError as exc:
        raise ConfigurationError(
            f"--use_fsdp with these --fsdp_* settings: {exc} (the launch flags are "
            "--fsdp_transformer_layer_cls_to_wrap and --fsdp_min_num_params)"
        ) from None
    return env


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validate parsed flags, over the config file's settings, into a :class:`LaunchConfig`.

    Raises:
        ValueError: naming the bad value, where it came from (flag or config file key) and the
            fix.
    """
    if not args.script:
        raise ConfigurationError(
            "no script to run: give the training script (or a module with -m) after the "
            "options, and its own arguments after it, e.g. "
            "`accelkit launch --cpu --num_processes 2 train.py --lr 1e-3`."
        )
    s = _merged_settings(args)
    module, no_python = s.flag("module"), s.flag("no_python")
    if module and no_python:
        raise ConfigurationError("--module and --no_python exclude each other: choose one.")
    cpu = s.flag("cpu")
    num_machines = s.integer("num_machines", 1) or 1
    machine_rank = s.integer("machine_rank", 0) or 0
    gpu_ids = None if cpu else _gpu_ids(s)
    num_processes = s.integer("num_processes", 1)
    if num_processes is not None and num_processes // num_machines > _MAX_LOCAL_PROCESSES:
        # torchrun builds every worker's settings before starting any: 10**8 of them took
        # minutes and GiBs before the first process, with nothing on screen.
        raise ConfigurationError(
            f"{s.origin('num_processes')}: {num_processes} process(es) over {num_machines} "
            f"machine(s) is more than {_MAX_LOCAL_PROCESSES} per machine; give the total "
            "over all machines, at most one per CPU core or GPU of each."
        )
    if num_processes is None:
        gpus = 0 if cpu else len(gpu_ids) if gpu_ids else _cuda_device_count()
        num_processes = max(gpus, 1) * num_machines
    if num_processes % num_machines:
        raise ConfigurationError(
            f"--num_processes {num_processes} is the total over all machines and must be a "
            f"multiple of --num_machines {num_machines}."
        )
    if machine_rank >= num_machines:
        raise ConfigurationError(
            f"--machine_rank {machine_rank} must be below --num_machines {num_machines} "
            "(ranks count from 0)."
        )
    port = s.integer("main_process_port", 0)
    if port is not None and port > 65535:
        raise ConfigurationError(f"{s.origin('main_process_port')}: must be <= 65535, got {port}.")
    if not port:
        port = 29500 if num_machines > 1 and port is None else _free_port()
    env = _fsdp_env(s)
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    threads = s.integer("num_cpu_threads_per_process", 1)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if s.flag("debug"):
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if s.flag("quiet"):
        env["LOGLEVEL"] = "ERROR"
    options = [f"{flag}={s.raw(name)}" for name, flag in _TORCHRUN_OPTIONS.items() if s.raw(name)]
    backend = s.raw("rdzv_backend")
    if backend is not None and str(backend) != "static":
        options.append(f"--rdzv-backend={backend}")
    precision = _mixed_precision(s)
    if not module and not no_python and not os.path.isfile(args.script):
        raise ConfigurationError(
            f"Script {args.script!r} does not exist (looked in {os.getcwd()}). Pass the path of a "
            "Python file, or -m/--module to run a module."
        )
    return LaunchConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        num_processes=num_processes,
        num_machines=num_machines,
        machine_rank=machine_rank,
        main_process_ip=str(s.raw("main_process_ip") or "127.0.0.1"),
        main_process_port=port,
        mixed_precision=precision,
        cpu=cpu,
        module=module,
        no_python=no_python,
        max_restarts=s.integer("max_restarts", 0) or 0,
        extra_env=tuple(sorted(env.items())),
        torchrun_options=tuple(options),
    )


def _cuda_device_count() -> int:
    # torch is imported only when the device count matters: `accelkit ckpt` and `--help`
    # must not pay for it.
    import torch

    return int(torch.cuda.device_count())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_args(config: LaunchConfig) -> list[str]:
    """The ``torch.distributed.run`` argument list for ``config``."""
    args = [
        f"--nnodes={config.num_machines}",
        f"--nproc_per_node={config.nproc_per_node}",
        f"--node_rank={config.machine_rank}",
        f"--master_addr={config.main_process_ip}",
        f"--master_port={config.main_process_port}",
        f"--max_restarts={config.max_restarts}",
        *config.torchrun_options,
    ]
    if any(option.startswith("--rdzv-backend=") for option in config.torchrun_options):
        args.append(f"--rdzv-endpoint={config.main_process_ip}:{config.main_process_port}")
    # Each worker starts through the death-signal step of accelkit.launch.signals, which then
    # runs the script as torchrun would have (python -u, -m, or the executable itself).
    worker = guarded_command(sys.executable, config.script, config.script_args, _mode(config))
    return [*args, "--no-python", *worker]


def _mode(config: LaunchConfig) -> str:
    return "module" if config.module else "exec" if config.no_python else "python"


def launch_env(config: LaunchConfig) -> dict[str, str]:
    """The environment every worker gets on top of the current one."""
    env = dict(os.environ)
    env[ENV_MIXED_PRECISION] = config.mixed_precision
    env.update(config.extra_env)
    if config.cpu:
        env[ENV_USE_CPU] = "1"
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        # torchrun would print a warning and set 1; give each worker its share of the cores.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // config.nproc_per_node))
    return env


def launch_command(config: LaunchConfig, at_failure: Callable[[str], None] | None = None) -> int:
    """Run the script as ``config`` says; return the exit code (non-zero if any worker failed).

    ``at_failure(memory)``, when given, is called with the job's shared-memory folder after a
    job that failed (non-zero exit) on the first machine, when its workers are gone and
    before the folder is removed: what the command line plugs in to commit the memory tier's
    newest snapshot (:func:`accelkit.checkpointing.memory.promote.promote_snapshots`).

    One process on one machine runs the script directly; anything else goes through
    ``torch.distributed.run``, which shows the failing worker's error and exits non-zero.

    SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGQUIT to the launcher stops the whole job: every worker
    gets SIGTERM (through torchrun), the launcher waits for them (torchrun SIGKILLs a worker still
    running after 30 s; a second signal kills at once), prints one line and returns
    ``128 + signal``. A script with ``ProjectConfiguration(preemption_signals=("SIGTERM", ...))``
    saves on the way out and exits with ``preemption_exit_code`` (default 75), which the
    launcher then returns instead (see ``docs/guides/preemption.md``).

    If the launcher itself dies without forwarding anything (SIGKILL, the OOM killer), torchrun
    and every worker are SIGKILLed by Linux at once (``PR_SET_PDEATHSIG``, armed by each process
    before the script runs): no process of the job outlives it.

    The job's shared memory (:class:`~accelkit.launch.job_memory.JobMemory`, named to the
    workers in ``ACCELKIT_MEMORY_DIR``: the memory tier's snapshots) lives from here to the
    job's end, across the restarts of ``--max_restarts``, and is removed however the job ends.
    """
    env = launch_env(config)
    # Where the failing worker's error is recorded, for one last line that names it (see
    # accelkit.launch._failure): the temporary folder outlives the job, and only it.
    with tempfile.TemporaryDirectory(prefix="accelkit-launch-") as tmp, JobMemory() as memory:
        env[ENV_MEMORY_DIR] = memory  # the memory tier's folder, kept across restarts
        path = os.path.join(tmp, "failure.json")
        # Where a job that stopped for a preemption records its exit code (main process).
        env[ENV_PREEMPTION_FILE] = os.path.join(tmp, "preempted.json")
        env[ENV_PREEMPTION_JOB] = secrets.token_hex(16)  # a record must name this job

        def preempted() -> int | None:
            record = read_exit_record(env[ENV_PREEMPTION_FILE], env[ENV_PREEMPTION_JOB])
            return None if record is None else int(record["exit_code"])

        def stopped_because() -> str | None:
            record = read_exit_record(env[ENV_PREEMPTION_FILE], env[ENV_PREEMPTION_JOB])
            return None if record is None else hang_line(record)

        if config.num_processes == 1 and config.num_machines == 1:
            env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
            env[ENV_ERROR_FILE] = path  # torchrun's variable; without torchrun, ours to set

            def summarise(code: int) -> None:
                _say_failure(Failure(0, code, read_error_file(path) or ""))

            cmd = guarded_command(sys.executable, config.script, config.script_args, _mode(config))
            code = run_child(
                cmd,
                env,
                "the script",
                via_torchrun=False,
                on_failure=summarise,
                preempted=preempted,
                stopped_because=stopped_because,
            )
            return _ended(code, config, memory, at_failure)
        env[ENV_FAILURE_FILE] = path
        # torchrun's @record copies the root cause's error file to its own error file, and
        # logs an error line where it has none.
        env.setdefault(ENV_ERROR_FILE, os.path.join(tmp, "torchrun_error.json"))

        def summarise_torchrun(code: int) -> None:
            # torchrun itself failing (a rendezvous timeout) writes no failure: its own
            # report is the last thing printed.
            failure = read_failure(path)
            if failure is not None:
                _say_failure(failure)

        cmd = [sys.executable, "-m", "accelkit.launch._torchrun", *torchrun_args(config)]
        what = f"{config.nproc_per_node} worker(s) (through torchrun)"
        code = run_child(
            cmd,
            env,
            what,
            via_torchrun=True,
            on_failure=summarise_torchrun,
            preempted=preempted,
            stopped_because=stopped_because,
        )
        return _ended(code, config, memory, at_failure)


def _ended(
    code: int, config: LaunchConfig, memory: str, at_failure: Callable[[str], None] | None
) -> int:
    """The job's exit code, after ``at_failure(memory)`` for a failed job on the first machine
    (its failure never changes the code: it says what went wrong itself)."""
    if code != 0 and at_failure is not None and config.machine_rank == 0:
        at_failure(memory)
    return code


def hang_line(record: dict[str, Any]) -> str | None:
    """The launcher's line for a job the hang watchdog stopped (``"reason": "hang"`` in its exit
    record, see ``docs/guides/watchdog.md``); ``None`` for any other record. The record is
    untrusted input: its values are shown escaped and clipped."""
    if record.get("reason") != "hang":
        return None
    rank, seconds, stacks = record.get("rank"), record.get("seconds"), record.get("stacks")
    folder = clip(stacks, 1000) if isinstance(stacks, str) else short(stacks)
    return (
        f"hang: rank {short(rank)} made no step progress for {short(seconds)} s "
        f"(hang_timeout_seconds); every rank's Python stack is in {folder} "
        "(the newest committed checkpoint is what a restart resumes from)"
    )


def _say_failure(failure: Failure) -> None:
    print(f"accelkit launch: {failure_line(failure)}", file=sys.stderr, flush=True)
