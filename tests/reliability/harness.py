"""Crash harness: a "zygote" process that forks checkpoint savers and checkers on request.

Starting a Python process that imports torch and accelkit takes seconds on a small machine, so
the crash tests start this script once (``python tests/reliability/harness.py``); it imports
everything, then reads one JSON command per line on stdin and answers one JSON line on stdout:

- ``{"cmd": "save", "project": P, "options": {...}, "total_limit": K, "run": R, "events": F,
  "log": L}``: fork a *saver* that resumes from the newest committed checkpoint under ``P``
  (if any) and then saves in a loop with automatic naming and ``total_limit=K`` until it is
  killed (or until ``"saves"`` saves when given). It appends ``ready``, ``begin <n>`` and
  ``committed <n>`` lines to ``F``. Answers ``{"pid": ...}`` at once.
- ``{"cmd": "wait", "pid": N}``: reap a saver; answers ``{"status": ...}`` (``-9`` if killed).
- ``{"cmd": "check", "project": P, "options": {...}, "out": F, "log": L}``: fork a fresh
  *checker* that lists the checkpoints, loads the newest committed one with
  ``Accelerator.load_state()`` into fresh objects, checks that every loaded part belongs to
  that very save, and runs ``accelkit ckpt verify`` on the checkpoints folder; it writes its
  findings to ``F`` (JSON) and the zygote answers with them.

Every saved state is *stamped*: before saving checkpoint ``n`` the model's parameter ``k`` is
filled with ``n + k / 64 + run``, and a registered object records ``n``, the run id and the
number of optimizer steps taken. A checkpoint that mixes files of two saves (or two runs) is
then caught by the checker.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from typing import Any

WIDTH = 192
LAYERS = 6


def _stamp(n: int, k: int, run: int) -> float:
    return float(n) + k / 64.0 + float(run)


class Counter:
    """A registered object: the iteration it was saved at, the run id and optimizer steps."""

    def __init__(self) -> None:
        self.iteration = -1
        self.run = -1
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration, "run": self.run, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iteration, self.run, self.steps = state["iteration"], state["run"], state["steps"]


def _build(project: str, options: dict[str, Any], total_limit: int | None) -> Any:
    import torch
    from torch import nn

    from accelkit import Accelerator, ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=True,
        total_limit=total_limit,
        storage_options=options,
    )
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, counter


def _emit(fd: int, line: str) -> None:
    os.write(fd, f"{line} @{time.monotonic():.4f}\n".encode())


def saver(cmd: dict[str, Any]) -> None:
    """Resume, then save in a loop (stamping each state) until killed."""
    import torch

    from accelkit.checkpointing.errors import CheckpointError

    events = os.open(cmd["events"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    accelerator, model, optimizer, counter = _build(
        cmd["project"], cmd["options"], cmd.get("total_limit")
    )
    try:
        accelerator.load_state()
    except CheckpointError as exc:
        if "No committed checkpoint" not in str(exc):
            raise
    run = int(cmd.get("run", 0))
    x = torch.randn(8, WIDTH)
    _emit(events, f"ready {accelerator.save_iteration}")
    saves = cmd.get("saves")
    done = 0
    while saves is None or done < saves:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        counter.steps += 1
        n = accelerator.save_iteration
        counter.iteration, counter.run = n, run
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                p.fill_(_stamp(n, k, run))
        _emit(events, f"begin {n}")
        try:
            path = accelerator.save_state()
        except CheckpointError as exc:
            _emit(events, "refused " + json.dumps(str(exc)))
            raise
        _emit(events, f"committed {n} {path}")
        done += 1


def checker(cmd: dict[str, Any]) -> dict[str, Any]:
    """Inspect the checkpoints under ``project`` as a fresh process would."""
    import torch

    from accelkit.checkpointing.catalog.listing import list_checkpoints
    from accelkit.checkpointing.storage import get_storage, join
    from accelkit.cli.main import main as cli

    project, options = cmd["project"], cmd["options"]
    root = join(project, "checkpoints")
    storage = get_storage(root, options)
    infos = list_checkpoints(storage, root)
    out: dict[str, Any] = {
        "states": {i.name: i.state for i in infos},
        "committed": sorted(i.iteration for i in infos if i.state == "committed"),
        "incomplete": sorted(i.iteration for i in infos if i.state == "incomplete"),
        "corrupt": {i.name: i.error for i in infos if i.state == "corrupt"},
    }
    accelerator, model, optimizer, counter = _build(project, options, None)
    if out["committed"]:
        path = accelerator.load_state()
        n = int(path.rstrip("/").rsplit("_", 1)[-1])
        problems = []
        if counter.iteration != n:
            problems.append(f"counter says iteration {counter.iteration}, folder is {n}")
        for k, p in enumerate(model.parameters()):
            want = _stamp(n, k, counter.run)
            if not torch.equal(p.detach(), torch.full_like(p, want)):
                problems.append(f"parameter {k} is not stamped {want}")
        for state in optimizer.state_dict()["state"].values():
            if int(state["step"]) != counter.steps:
                problems.append(f"optimizer step {int(state['step'])} != {counter.steps}")
                break
        out.update(
            loaded=n,
            loaded_run=counter.run,
            problems=problems,
            next_iteration=accelerator.save_iteration,
        )
        flags = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in options.items()]
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            out["verify_rc"] = cli(["ckpt", "verify", root, *[a for f in flags for a in ("-o", f)]])
        out["verify_out"] = buffer.getvalue()
    return out


def _fork(log: str, body: Any) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        body()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def main() -> None:
    """The zygote's command loop."""
    import s3fs  # noqa: F401 - imported before any fork, like torch
    import torch

    import accelkit.checkpointing.manager
    import accelkit.cli.ckpt  # noqa: F401
    from accelkit import Accelerator  # noqa: F401

    # One intra-op thread: OpenMP's pool does not survive fork() well (each forked child
    # ran ~10x slower with it), and the savers are tiny.
    torch.set_num_threads(1)
    # Import what the first optimizer pulls in lazily (torch._dynamo: seconds) once, here.
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    reply = sys.stdout
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "save":
            pid = _fork(cmd["log"], lambda c=cmd: saver(c))
            answer: dict[str, Any] = {"pid": pid}
        elif cmd["cmd"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            answer = {"status": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else status >> 8}
        elif cmd["cmd"] == "check":

            def body(c: dict[str, Any] = cmd) -> None:
                result = checker(c)
                with open(c["out"], "w") as f:
                    json.dump(result, f)

            pid = _fork(cmd["log"], body)
            _, status = os.waitpid(pid, 0)
            if status == 0 and os.path.exists(cmd["out"]):
                with open(cmd["out"]) as f:
                    answer = {"ok": True, "result": json.load(f)}
            else:
                answer = {"ok": False, "status": status}
        else:
            answer = {"error": f"unknown command {cmd['cmd']!r}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
