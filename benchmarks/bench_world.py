"""Coordination cost of a save and a load as the world grows (2 to 16 gloo processes).

Every process of a real ``torch.distributed`` job (gloo on 127.0.0.1) saves and loads a small
state (a prepared model + AdamW; small so that the coordination, not the bytes, is measured)
with automatic naming, sync. Around each ``save_state`` and ``load_state`` the benchmark counts
the collective calls accelkit makes through ``torch.distributed`` (``all_gather_object``,
``broadcast_object_list``, ``all_reduce``, ``barrier``, ...) and the bytes each process sends in
them (the pickled size of an object collective's payload, a tensor collective's ``nbytes``).
The counting wraps the functions of the ``torch.distributed`` namespace, which is what
accelkit calls; an object collective is one call here and two rounds inside torch (a size
exchange, then the data).

Targets: the number of collective calls per save and per load, and the bytes one process
sends, are the same at 16 processes as at 2 (flat in world size). On this 2-core machine 16
processes are CPU-starved: the time per call is reported, not judged. A plot goes to
``benchmarks/results/world.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Target, print_table, results_dir, section, write_result

COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
)
# Positional index of the payload a process sends, per collective (object lists: the list).
_SENT_ARG = {
    "all_gather_object": 1,
    "broadcast_object_list": 0,
    "gather_object": 0,
    "scatter_object_list": 1,
    "all_reduce": 0,
    "all_gather": 1,
    "all_gather_into_tensor": 1,
    "broadcast": 0,
    "reduce": 0,
    "gather": 0,
    "scatter": 1,
}


def _payload_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    import torch

    index = _SENT_ARG.get(name)
    if index is None:
        return 0
    value = args[index] if len(args) > index else next(iter(kwargs.values()), None)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if name == "broadcast_object_list":
        # Only the source sends; the others' list holds placeholders.
        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        import torch.distributed as dist

        if dist.get_rank() != src:
            return 0
    try:
        return len(pickle.dumps(value))
    except Exception:
        return 0


class Counter:
    """Counts the collective calls (and the bytes sent) made through ``torch.distributed``."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.sent = 0

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def counted(*args: Any, _name: str = name, _fn: Any = original, **kwargs: Any) -> Any:
                self.calls[_name] = self.calls.get(_name, 0) + 1
                self.sent += _payload_bytes(_name, args, kwargs)
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)

    def take(self) -> dict[str, Any]:
        out = {"calls": sum(self.calls.values()), "by_name": dict(self.calls), "sent": self.sent}
        self.calls, self.sent = {}, 0
        return out


def _worker(out: str, repeats: int) -> None:
    import torch
    from torch import nn

    from accelkit import Accelerator, ProjectConfiguration

    root = os.environ["BENCH_WORLD_DIR"]
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

    counter = Counter()
    counter.install()
    accelerator.save_state()  # warm-up: the first save also takes the run lock
    accelerator.load_state()
    counter.take()
    rows: dict[str, list[dict[str, Any]]] = {"save": [], "load": []}
    for _ in range(repeats):
        start = time.perf_counter()
        accelerator.save_state()
        seconds = time.perf_counter() - start
        rows["save"].append({**counter.take(), "seconds": seconds})
        start = time.perf_counter()
        accelerator.load_state()
        seconds = time.perf_counter() - start
        rows["load"].append({**counter.take(), "seconds": seconds})
    accelerator.end_training()
    Path(out).write_text(json.dumps({"rank": accelerator.process_index, "rows": rows}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, repeats: int) -> list[dict[str, Any]]:
    """Run one job of ``world`` processes; return each rank's measurements."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench-world-") as tmp:
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                ACCELKIT_USE_CPU="1",
                BENCH_WORLD_DIR=os.path.join(tmp, "project"),
            )
            cmd = [sys.executable, "-m", "benchmarks.bench_world", "--worker"]
            cmd += ["--out", os.path.join(tmp, f"rank{rank}.json"), "--repeats", str(repeats)]
            procs.append(subprocess.Popen(cmd, env=env, cwd=Path(__file__).parent.parent))
        deadline = time.monotonic() + 120 + 30 * world
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"world {world}: a process hung past the deadline") from None
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"world {world}: exit codes {codes}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def _summary(ranks: list[dict[str, Any]], op: str) -> dict[str, Any]:
    """Per op: calls (the same on every rank, checked), max bytes sent, median seconds."""
    calls = {row["calls"] for r in ranks for row in r["rows"][op]}
    by_name = ranks[0]["rows"][op][-1]["by_name"]
    sent = max(row["sent"] for r in ranks for row in r["rows"][op])
    main_sent = max(row["sent"] for row in ranks[0]["rows"][op])
    other_sent = max((row["sent"] for r in ranks[1:] for row in r["rows"][op]), default=0)
    secs = sorted(row["seconds"] for row in ranks[0]["rows"][op])
    seconds = secs[len(secs) // 2]
    n_calls = max(calls)
    return {
        "calls": n_calls,
        "calls_agree": len(calls) == 1,
        "by_name": by_name,
        "max_sent_bytes": sent,
        "main_sent_bytes": main_sent,
        "other_sent_bytes": other_sent,
        "seconds": seconds,
        "seconds_per_call": seconds / n_calls if n_calls else float("nan"),
    }


def _plot(worlds: list[int], table: dict[str, dict[int, dict[str, Any]]], quick: bool) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for op, per_world in table.items():
        left.plot(worlds, [per_world[w]["calls"] for w in worlds], marker="o", label=op)
        right.plot(worlds, [per_world[w]["max_sent_bytes"] for w in worlds], marker="o", label=op)
    for ax, label in ((left, "collective calls per operation"), (right, "bytes sent, max rank")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_xlabel("processes (gloo)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Coordination per save_state / load_state vs world size")
    fig.tight_layout()
    path = results_dir(quick) / "world.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def main(quick: bool = False) -> dict[str, Any]:
    """Measure 2..16 processes (quick: 2 and 4), write ``results/world.json`` and the plot."""
    worlds = [2, 4] if quick else [2, 4, 8, 16]
    repeats = 2 if quick else 3
    table: dict[str, dict[int, dict[str, Any]]] = {"save": {}, "load": {}}
    with section(f"coordination per save and load, {worlds[0]}..{worlds[-1]} processes"):
        for world in worlds:
            ranks = run_world(world, repeats)
            for op in table:
                table[op][world] = _summary(ranks, op)
        rows = [
            [
                op,
                w,
                s["calls"],
                s["main_sent_bytes"],
                s["other_sent_bytes"],
                round(s["seconds"], 4),
                round(s["seconds_per_call"] * 1e3, 2),
            ]
            for op, per_world in table.items()
            for w, s in per_world.items()
        ]
        print_table(rows, ["op", "processes", "calls", "sent main", "sent other", "s", "ms/call"])
    plot = _plot(worlds, table, quick)
    low, high = worlds[0], worlds[-1]
    targets = []
    for op, per_world in table.items():
        targets.append(
            Target(
                f"{op}: collective calls at {high} / at {low} processes",
                per_world[high]["calls"] / per_world[low]["calls"],
                1.0,
                unit="x",
                higher_is_better=False,
            )
        )
        targets.append(
            Target(
                f"{op}: bytes one process sends at {high} / at {low} processes",
                per_world[high]["max_sent_bytes"] / max(1, per_world[low]["max_sent_bytes"]),
                1.1,
                unit="x",
                higher_is_better=False,
            )
        )
        targets.append(
            Target(
                f"{op}: every rank makes the same collective calls",
                float(all(s["calls_agree"] for s in per_world.values())),
                1.0,
                unit="bool",
            )
        )
    results = {"worlds": worlds, "repeats": repeats, "plot": plot, "table": table}
    notes = [
        "calls: collective calls through torch.distributed per operation (an object collective "
        "is two rounds inside torch); sent: bytes one process hands to them.",
        "an all-gather hands every process the others' payloads: what one process receives "
        "grows with the world by nature; what it sends, and the number of calls, must not.",
        "2 cores: 8 and 16 processes are CPU-starved; seconds are reported, not judged.",
        f"load average at the end: {os.getloadavg()}",
    ]
    write_result(
        "world",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Coordination vs world size",
    )
    for t in targets:
        bound = ">=" if t.higher_is_better else "<="
        mark = "ok  " if t.passed else "MISS"
        print(f"   {mark} {t.name}: {t.value:.3g} ({bound} {t.threshold})")
    return results


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.out, args.repeats)
    else:
        main(quick=args.quick)


if __name__ == "__main__":
    _cli()
