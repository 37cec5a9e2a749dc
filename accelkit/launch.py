"""Starting processes: ``accelkit launch`` and :func:`notebook_launcher`.

accelkit writes no process manager of its own. ``accelkit launch`` translates the flags users know
from the reference tool into a ``torch.distributed.run`` (torchrun) invocation, and
:func:`notebook_launcher` uses ``torch.multiprocessing.start_processes``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accelkit._launch_signals import run_child
from accelkit.environment import ENV_MIXED_PRECISION, ENV_USE_CPU, parse_mixed_precision
from accelkit.fsdp_plugin import add_launch_arguments as add_fsdp_arguments
from accelkit.fsdp_plugin import launch_env as fsdp_launch_env

__all__ = ["LaunchConfig", "launch_command", "notebook_launcher", "torchrun_args"]


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
    max_restarts: int = 0
    extra_env: tuple[tuple[str, str], ...] = ()

    @property
    def nproc_per_node(self) -> int:
        """Processes started on this machine."""
        return self.num_processes // self.num_machines


def _positive(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _non_negative(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {value}")
        return value

    return parse


def _precision(text: str) -> str:
    try:
        return parse_mixed_precision(text).value
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``accelkit launch`` flags to ``parser``."""
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo, even with GPUs")
    parser.add_argument(
        "--multi_gpu", action="store_true", help="one process per GPU (default count: all GPUs)"
    )
    parser.add_argument(
        "--num_processes",
        type=_positive("--num_processes"),
        default=None,
        help="total processes over all machines (default: GPUs on this machine, or 1)",
    )
    parser.add_argument("--num_machines", type=_positive("--num_machines"), default=1)
    parser.add_argument("--machine_rank", type=_non_negative("--machine_rank"), default=0)
    parser.add_argument("--main_process_ip", default="127.0.0.1")
    parser.add_argument("--main_process_port", type=_positive("--main_process_port"), default=None)
    parser.add_argument("--mixed_precision", type=_precision, default=None, help="no | fp16 | bf16")
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the script as a module (python -m)"
    )
    parser.add_argument(
        "--max_restarts",
        type=_non_negative("--max_restarts"),
        default=0,
        help="restart the workers this many times after a failure (torchrun)",
    )
    add_fsdp_arguments(parser)
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validate parsed flags into a :class:`LaunchConfig`.

    Raises:
        ValueError: naming the bad value and the fix.
    """
    if not args.module and not os.path.isfile(args.script):
        raise ValueError(
            f"Script {args.script!r} does not exist (looked in {os.getcwd()}). Pass the path of a "
            "Python file, or -m/--module to run a module."
        )
    gpus = 0 if args.cpu else _cuda_device_count()
    num_processes = args.num_processes
    if num_processes is None:
        num_processes = max(gpus, 1) * args.num_machines
    if num_processes % args.num_machines:
        raise ValueError(
            f"--num_processes {num_processes} is the total over all machines and must be a "
            f"multiple of --num_machines {args.num_machines}."
        )
    if args.machine_rank >= args.num_machines:
        raise ValueError(
            f"--machine_rank {args.machine_rank} must be below --num_machines {args.num_machines} "
            "(ranks count from 0)."
        )
    port = args.main_process_port
    if port is None:
        port = 29500 if args.num_machines > 1 else _free_port()
    return LaunchConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        num_processes=num_processes,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        main_process_ip=args.main_process_ip,
        main_process_port=port,
        mixed_precision=args.mixed_precision or parse_mixed_precision(None).value,
        cpu=args.cpu,
        module=args.module,
        max_restarts=args.max_restarts,
        extra_env=tuple(sorted(fsdp_launch_env(args).items())),
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
    ]
    if config.module:
        args.append("--module")
    return [*args, config.script, *config.script_args]


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


def launch_command(config: LaunchConfig) -> int:
    """Run the script as ``config`` says; return the exit code (non-zero if any worker failed).

    One process on one machine runs the script directly; anything else goes through
    ``torch.distributed.run``, which shows the failing worker's error and exits non-zero.

    SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGQUIT to the launcher stops the whole job: every worker
    gets SIGTERM (through torchrun), the launcher waits for them (torchrun SIGKILLs a worker still
    running after 30 s; a second signal kills at once), prints one line and returns
    ``128 + signal``. To save on the way out, a script handles SIGTERM.
    """
    env = launch_env(config)
    if config.num_processes == 1 and config.num_machines == 1:
        target = ["-m", config.script] if config.module else [config.script]
        env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        cmd = [sys.executable, *target, *config.script_args]
        return run_child(cmd, env, "the script", via_torchrun=False)
    cmd = [sys.executable, "-m", "accelkit._torchrun", *torchrun_args(config)]
    what = f"{config.nproc_per_node} worker(s) (through torchrun)"
    return run_child(cmd, env, what, via_torchrun=True)


class _Worker:
    """Picklable entry point for :func:`notebook_launcher` workers."""

    def __init__(self, function: Callable[..., Any], world_size: int, env: dict[str, str]) -> None:
        self.function = function
        self.world_size = world_size
        self.env = env

    def __call__(self, rank: int, *args: Any) -> None:
        os.environ.update(self.env)
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size),
            }
        )
        try:
            self.function(*args)
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = None,
    master_addr: str = "127.0.0.1",
    cpu: bool = False,
    start_method: str = "fork",
) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes from a notebook or Python session.

    Args:
        function: the training function (define CUDA objects inside it, not before).
        args: positional arguments passed to every process.
        num_processes: processes to start (default: GPUs, or 1 on a CPU-only machine).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` for every worker's Accelerator.
        use_port: the rendezvous port (default: a free one).
        master_addr: the rendezvous address.
        cpu: force CPU workers (gloo).
        start_method: ``"fork"`` (works with functions defined in a notebook) or ``"spawn"``.

    Raises:
        ValueError: for ``num_processes < 1`` or an unknown precision.
        torch.multiprocessing.ProcessRaisedException: with the failing worker's traceback.
    """
    import torch

    precision = parse_mixed_precision(mixed_precision).value
    if num_processes is None:
        num_processes = max(1, 0 if cpu else torch.cuda.device_count())
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(use_port or _free_port()),
        ENV_MIXED_PRECISION: precision,
    }
    if cpu or not torch.cuda.is_available():
        env[ENV_USE_CPU] = "1"
    if num_processes == 1:
        saved = dict(os.environ)
        try:
            _Worker(function, 1, env)(0, *args)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was initialised in this process before notebook_launcher; forked workers "
            "cannot use it. Move every CUDA call inside the launched function and restart the "
            "kernel."
        )
    import torch.multiprocessing as tmp

    tmp.start_processes(
        _Worker(function, num_processes, env),
        args=tuple(args),
        nprocs=num_processes,
        start_method=start_method,
    )
