"""A training job for the preemption tests and soak: preempted by a real signal at a chosen
moment, resumed with ``load_state()``, and summarised by a digest of everything exact resume
promises (parameters, optimizer state, every RNG) so that two runs compare bitwise.

Two scripts in one, as users write them:

* ``unchanged``: an Accelerate-style loop that never asks (it only has ``preemption_signals``
  in its ``ProjectConfiguration``) and saves with ``save_state()`` every ``save_every`` steps
  itself; accelkit saves it on a preemption and exits with the preemption exit code.
* ``explicit``: a loop that asks ``should_save()`` every step and stops on
  ``preemption_requested`` by itself (``sys.exit(75)`` after ``end_training()``).

Used three ways: :func:`train` in-process or in :func:`tests.helpers.distributed.run_distributed`
workers (a preemption exit becomes ``{"exit": code}``), and as a script under ``accelkit launch``
(``python tests/helpers/preemption_job.py PROJECT --total 40 ...``; the result JSON is written to
``--out``). Self-contained: it imports only accelkit, torch and numpy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

WHERE = ("before", "backward", "step", "eval", "async")


class Counter:
    """The script's own step counter, checkpointed with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


def _model(state_mb: float) -> torch.nn.Module:
    torch.manual_seed(1234)
    # A wide first layer carries the state's size (fp32: 4 bytes a parameter).
    width = max(8, int(state_mb * 2**20 / 4 / 64)) if state_mb else 32
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # draws from the global RNG every step: RNG must resume too
        torch.nn.Linear(width, 4),
    )


def _data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(n, 64, generator=g), torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(inputs, targets)


def digest(model: torch.nn.Module, optimizer: Any) -> str:
    """sha256 of the parameters, the optimizer state and every RNG of this process."""
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        h.update(torch.cuda.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def train(
    project: str,
    *,
    total: int = 24,
    mode: str = "unchanged",
    where: str = "",
    signal_at: int = -1,
    signal_rank: int = 0,
    signum: str = "SIGUSR1",
    save_every: int = 0,
    async_save: bool = False,
    eval_every: int = 0,
    state_mb: float = 0.0,
    resume: bool = False,
    progress: str = "",
    step_sleep: float = 0.0,
    replicate_to: str | None = None,
    replicate_options: dict[str, Any] | None = None,
    cpu: bool = True,
) -> dict[str, Any]:
    """Run the job; see the module's docstring. Returns ``{"exit": code}`` after a preemption
    exit, else ``{"steps", "digest", "rank"}``."""
    from accelkit import Accelerator, ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=True,
        preemption_signals=("SIGTERM", "SIGUSR1"),
        async_save=async_save,
        replicate_to=replicate_to,
        **(replicate_options or {}),
    )
    accelerator = Accelerator(cpu=cpu, project_config=config)
    random.seed(1234)
    np.random.seed(1234)
    model = _model(state_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    loader = torch.utils.data.DataLoader(_data(8 * 16, 0), batch_size=8, shuffle=True)
    val = torch.utils.data.DataLoader(_data(4 * 8, 1), batch_size=8)
    model, optimizer, scheduler, loader, val = accelerator.prepare(
        model, optimizer, scheduler, loader, val
    )
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    rank = accelerator.process_index
    me = rank == signal_rank
    number = int(getattr(signal, signum))

    def send(now: str) -> None:
        if me and where == now and counter.steps == signal_at:
            if progress:  # when, for the soak's signal-to-exit time
                Path(f"{progress}.sent").write_text(repr(time.time()))
            os.kill(os.getpid(), number)

    def in_backward(grad: torch.Tensor) -> torch.Tensor:
        send("backward")
        return grad

    first = model.module[0] if hasattr(model, "module") else model[0]
    first.weight.register_hook(in_backward)
    if resume and os.path.isdir(os.path.join(project, "checkpoints")):
        accelerator.load_state()
    if progress:  # the soak signals one worker by its pid
        Path(f"{progress}.pid{rank}").write_text(str(os.getpid()))
    if where == "before" and me:
        if progress:
            Path(f"{progress}.sent").write_text(repr(time.time()))
        os.kill(os.getpid(), number)
    step_times: list[float] = []
    save_times: list[float] = []
    try:
        while counter.steps < total:
            for x, y in loader:
                if counter.steps >= total:
                    break
                started = time.perf_counter()
                model.train()
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                send("step")  # between optimizer.step() and scheduler.step(): never saved here
                scheduler.step()
                optimizer.zero_grad()
                counter.steps += 1
                if progress and rank == 0:
                    Path(progress).write_text(str(counter.steps))
                if step_sleep:
                    time.sleep(step_sleep)
                step_times.append(time.perf_counter() - started)
                if save_every and counter.steps % save_every == 0 and mode == "unchanged":
                    started = time.perf_counter()
                    accelerator.save_state()  # with async_save: only its blocking part
                    save_times.append(time.perf_counter() - started)
                    send("async")
                if eval_every and counter.steps % eval_every == 0:
                    model.eval()
                    with torch.no_grad():
                        for i, (vx, vy) in enumerate(val):
                            if i == 1:
                                send("eval")
                            torch.nn.functional.mse_loss(model(vx), vy)
                # The end of the loop body: where a script that asks saves, so that a resumed
                # run continues with the next step (not with this step's evaluation).
                if mode == "explicit":
                    if accelerator.should_save():
                        accelerator.save_state()
                    if accelerator.preemption_requested:
                        break
            if mode == "explicit" and accelerator.preemption_requested:
                accelerator.end_training()
                raise SystemExit(75)
    except SystemExit as exc:
        return {"exit": exc.code, "rank": rank}
    accelerator.wait_for_checkpoints()
    result = {
        "steps": counter.steps,
        "digest": digest(model, optimizer),
        "rank": rank,
        "device": str(next(model.parameters()).device),
        "step_s": sorted(step_times)[len(step_times) // 2] if step_times else 0.0,
        "max_step_s": max(step_times, default=0.0),
        "max_save_s": max(save_times, default=0.0),
    }
    accelerator.end_training()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("--out", default="")
    for name, kind in (
        ("total", int),
        ("signal_at", int),
        ("signal_rank", int),
        ("save_every", int),
        ("eval_every", int),
        ("state_mb", float),
        ("step_sleep", float),
    ):
        parser.add_argument(f"--{name}", type=kind, default=None)
    parser.add_argument("--mode", default="unchanged")
    parser.add_argument("--where", default="")
    parser.add_argument("--signum", default="SIGUSR1")
    parser.add_argument("--progress", default="")
    parser.add_argument("--async_save", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    project = args.pop("project")
    kwargs = {k: v for k, v in args.items() if v is not None}
    result = train(project, **kwargs)
    if out and "exit" not in result:
        Path(f"{out}.{result['rank']}").write_text(json.dumps(result))
    if "exit" in result:
        return int(result["exit"] or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
