"""``notebook_launcher``: run a function on several processes from a notebook or Python session.

Built, as in Accelerate, on torch's elastic launcher (``torch.distributed.launcher.api``:
``elastic_launch`` with a ``LaunchConfig``), so it has torch's rendezvous (``static`` or
``c10d``, over one or several nodes), restarts (``max_restarts``) and monitoring: when a worker
fails, the agent stops the others within ``monitor_interval`` seconds and, once no restart is
left, raises torch's ``ChildFailedError`` naming the failing rank and its exception.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from accelkit.errors import ConfigurationError, UsageError
from accelkit.runtime.environment import (
    ACCELERATE_ENV_MIXED_PRECISION,
    ENV_MIXED_PRECISION,
    ENV_USE_CPU,
    parse_mixed_precision,
)

__all__ = ["notebook_launcher"]

_logger = logging.getLogger(__name__)

#: Accelerate's default port when several nodes must agree on one.
DEFAULT_PORT = "29500"
_RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _callable_name(function: Callable[..., Any], attribute: str) -> str:
    """``function``'s ``attribute`` name, looking through partials, else its type's name."""
    while isinstance(function, functools.partial):
        function = function.func
    name = getattr(function, attribute, None)
    return name if isinstance(name, str) else type(function).__name__


class _Entrypoint:
    """Picklable worker body: run the function, then leave the process group cleanly."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        # torch's agent names the run (and its logs) after the entrypoint's __qualname__.
        functools.update_wrapper(self, function)
        # A functools.partial, or any callable object, has no __name__ to copy, and the agent
        # fails reading it: name the entrypoint after what it calls.
        for attribute in ("__name__", "__qualname__"):
            if attribute not in vars(self):
                setattr(self, attribute, _callable_name(function, attribute))

    def __call__(self, *args: Any) -> Any:
        try:
            return self.function(*args)
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


@contextlib.contextmanager
def _patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (the workers inherit them), then restore it."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _child_failed(entrypoint: _Entrypoint, error: Exception) -> Exception:
    """torch's ``ChildFailedError`` for ``error`` raised by rank 0 in this process, with the
    message and traceback the agent reports for a worker (from the error file torch's
    ``ErrorHandler`` writes; called while ``error`` is being handled)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    with tempfile.TemporaryDirectory() as folder:
        error_file = os.path.join(folder, "error.json")
        with _patched_environ({"TORCHELASTIC_ERROR_FILE": error_file}):
            ErrorHandler().record_exception(error)
        failure = ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=1, error_file=error_file)
    name = _callable_name(entrypoint.function, "__qualname__")  # as the agent names it
    return ChildFailedError(name=name, failures={0: failure})


def _run_here(entrypoint: _Entrypoint, args: Sequence[Any], max_restarts: int) -> None:
    """Run rank 0 of a one-process run in this process, as the reference does, keeping the
    agent's contract: a failure is retried ``max_restarts`` times
    (``TORCHELASTIC_RESTART_COUNT`` counts them), then raised as ``ChildFailedError`` whose
    ``__cause__`` is the function's exception."""
    for attempt in range(max_restarts + 1):
        try:
            with _patched_environ({"TORCHELASTIC_RESTART_COUNT": str(attempt)}):
                entrypoint(*args)
            return
        except Exception as error:
            if attempt < max_restarts:
                _logger.warning(
                    "notebook_launcher: %s failed (%s: %s); restarting it (%d of %d restarts).",
                    _callable_name(entrypoint.function, "__qualname__"),
                    type(error).__name__,
                    error,
                    attempt + 1,
                    max_restarts,
                )
                continue
            raise _child_failed(entrypoint, error) from error


def _check(
    num_processes: int, node_rank: int, num_nodes: int, rdzv_backend: str, max_restarts: int
) -> None:
    if num_processes < 1:
        raise ConfigurationError(f"num_processes must be >= 1, got {num_processes}.")
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ConfigurationError(
            f"node_rank={node_rank} with num_nodes={num_nodes}: node_rank must be in "
            f"[0, num_nodes); number the nodes 0 to {max(num_nodes, 1) - 1}."
        )
    if rdzv_backend not in _RDZV_BACKENDS:
        raise ConfigurationError(
            f"Unknown rdzv_backend {rdzv_backend!r}. Expected one of {', '.join(_RDZV_BACKENDS)}."
        )
    if max_restarts < 0:
        raise ConfigurationError(f"max_restarts must be >= 0, got {max_restarts}.")


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    cpu: bool = False,
    start_method: str = "fork",
) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes per node (Accelerate's signature).

    One process on one node runs ``function`` in this process, as in Accelerate, but with the
    agent's contract (Accelerate raises the function's own exception there, and does not
    restart): a failure is retried ``max_restarts`` times, then raised as ``ChildFailedError``
    carrying the exception's message and traceback (the exception is its ``__cause__``).
    Otherwise torch's elastic agent starts the workers (each with ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``... set, so an ``Accelerator`` made inside ``function`` joins the run),
    watches them and restarts them.

    Args:
        function: the training function (define CUDA objects inside it, not before).
        args: positional arguments passed to every process.
        num_processes: processes per node (default: the GPUs, or 1 on a CPU-only machine).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` for every worker's Accelerator.
        use_port: the rendezvous port (default: a free one on one node; with several nodes,
            29500 as in Accelerate, since every node must use the same).
        master_addr: the rendezvous address.
        node_rank: this node's index.
        num_nodes: nodes in the run (start ``notebook_launcher`` on each).
        rdzv_backend: torch's rendezvous: ``"static"`` (node ranks given) or ``"c10d"``.
        rdzv_endpoint: the rendezvous ``host:port`` (default: ``master_addr:use_port``, for
            every backend; the reference leaves c10d's to torch, which picks port 29400).
        rdzv_conf: extra rendezvous settings (not modified).
        rdzv_id: the run's id, shared by its nodes.
        max_restarts: how many times the agent restarts all workers after a failure.
        monitor_interval: seconds between the agent's checks of the workers.
        log_line_prefix_template: torch's prefix for the workers' log lines (e.g.
            ``"[${role_name}${rank}]:"``).
        cpu: force CPU workers (gloo).
        start_method: ``"fork"`` (works with functions defined in a notebook) or ``"spawn"``.

    Raises:
        ValueError: for ``num_processes < 1``, a ``node_rank`` outside ``[0, num_nodes)``, an
            unknown ``rdzv_backend`` or precision.
        RuntimeError: when CUDA was initialised here before forking workers.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: when a worker still
            fails after ``max_restarts`` restarts (with its exception and traceback), on one
            process as on several.
    """
    import torch

    precision = parse_mixed_precision(mixed_precision).value
    if num_processes is None:
        num_processes = max(1, 0 if cpu else torch.cuda.device_count())
    _check(num_processes, node_rank, num_nodes, rdzv_backend, max_restarts)
    port = str(use_port or (DEFAULT_PORT if num_nodes > 1 else _free_port()))
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": port, ENV_MIXED_PRECISION: precision}
    # The reference's workers see ACCELERATE_MIXED_PRECISION; code in `function` may read it.
    env[ACCELERATE_ENV_MIXED_PRECISION] = precision
    if cpu or not torch.cuda.is_available():
        env[ENV_USE_CPU] = "1"
    if num_processes == 1 and num_nodes == 1:
        single = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        with _patched_environ({**env, **single}):
            _run_here(_Entrypoint(function), args, max_restarts)
        return
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise UsageError(
            "CUDA was initialised in this process before notebook_launcher; forked workers "
            "cannot use it. Move every CUDA call inside the launched function and restart the "
            "kernel."
        )
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    configs = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        configs["rank"] = node_rank
    # For every backend (the reference: static only; c10d then used torch's fixed
    # localhost:29400), so that runs side by side on one machine do not collide.
    endpoint = rdzv_endpoint or f"{master_addr}:{port}"
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=rdzv_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=configs,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        log_line_prefix_template=log_line_prefix_template,
    )
    with _patched_environ(env):
        elastic_launch(config=config, entrypoint=_Entrypoint(function))(*args)
