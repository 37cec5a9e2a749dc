"""Run a function in N real processes joined by a gloo process group on 127.0.0.1.

This is the one helper every multi-process test uses. Workers are forked from a forkserver that
has already imported torch, so a 2-process job costs well under a second to start instead of
the ~3 s of a fresh interpreter per process.

Example:
    >>> def _body(x):  # module level, so the worker can import it
    ...     import torch.distributed as dist
    ...     return dist.get_rank() * x
    >>> run_distributed(_body, 10)
    [0, 10]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["free_port", "run_distributed"]

_CTX = mp.get_context("forkserver")
# torch._dynamo is imported by the first optimizer a worker builds (several seconds here);
# importing it once in the server saves that in every worker.
_CTX.set_forkserver_preload(["torch", "numpy", "torch._dynamo"])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    out_dir: str,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import torch

    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        result = fn(*args)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run module-level ``fn(*args)`` on ``world_size`` processes; return each rank's result.

    Workers see the environment ``torch.distributed.run`` would give them (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and
    ``ACCELKIT_USE_CPU=1`` (override through ``env``). If any worker fails, the others are
    stopped and a ``RuntimeError`` carries the failing worker's traceback.
    """
    worker_env = {"ACCELKIT_USE_CPU": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="accelkit-dist-") as out_dir:
        procs = [
            _CTX.Process(
                target=_worker, args=(rank, world_size, port, fn, args, worker_env, out_dir)
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 5.0):
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = [
            f"--- rank {rank} ---\n{(Path(out_dir) / f'{rank}.err').read_text()}"
            for rank in range(world_size)
            if (Path(out_dir) / f"{rank}.err").exists()
        ]
        if errors:
            raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
        if time.monotonic() > deadline:
            raise TimeoutError(f"distributed job of {world_size} processes ran past {timeout} s")
        results = []
        for rank, p in enumerate(procs):
            path = Path(out_dir) / f"{rank}.pkl"
            if p.exitcode != 0 or not path.exists():
                raise RuntimeError(f"rank {rank} exited with code {p.exitcode} and no result")
            results.append(pickle.loads(path.read_bytes()))
        return results
