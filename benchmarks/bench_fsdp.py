"""Sharded checkpoint saves: time as the process count goes 1 -> 2 -> 4 on the same total state.

A stack of ``Linear`` layers is sharded with FSDP2 over N gloo processes (CPU), AdamW takes one
step (so its two moments exist), and :func:`accelkit.checkpointing.sharded.save_sharded` writes
model + optimizer state to a local folder: every process writes only its share, durably (fsync),
through ``torch.distributed.checkpoint``; the main process writes DCP's ``.metadata``. The time
of one save is taken on the main process from a barrier before to a barrier after (so it covers
the slowest process). The total state is the same for every N.

Each process count runs in its own job (forked workers, ``tests/helpers/distributed.py``); jobs
alternate their order over passes (1 2 4, 2 4 1, 4 1 2) so a burst of noise from another
process on this shared machine does not always hit the same N. Figures are medians.

Target (issue 11): "each process writes only its share, so the time must not grow with the
process count": save time at 4 processes <= 1.1x the time at 1 process (10% for noise).
On this 2-core machine 4 processes share 2 cores and one disk, so the figure shows that the
write does not serialise on one process, not a speed-up.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import Target, median, print_table, section, write_result

MB = 1_000_000
COUNTS = (1, 2, 4)


def _model(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _job(width: int, layers: int, saves: int, root: str) -> dict[str, Any]:
    """One process of an N-process job: shard, step, then time ``saves`` sharded saves."""
    import torch.distributed as dist

    from accelkit.checkpointing import sharded
    from accelkit.checkpointing.storage import get_storage
    from accelkit.fsdp import runtime as fsdp
    from accelkit.runtime.state import PartialState

    state = PartialState()
    torch.manual_seed(0)
    model = _model(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = fsdp.FullyShardedDataParallelPlugin(
        auto_wrap_policy=lambda m: isinstance(m, nn.Linear)
    )
    fsdp.FSDPRuntime(plugin, state.device, "no").prepare_model(model, [optimizer])
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    storage = get_storage(root)
    targets = sharded.sharded_targets([model], [optimizer])
    times: list[float] = []
    own_bytes = 0
    for i in range(saves):
        folder = f"{root}/save_{i}"
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        entries = sharded.save_sharded(storage, folder, targets, gather=False)
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
        own_bytes = sum(e.size for e in entries)
        if state.is_main_process:
            storage.rmtree(folder)
    return {"times": times, "own_bytes": own_bytes}


def _run(count: int, width: int, layers: int, saves: int) -> dict[str, Any]:
    from tests.helpers.distributed import run_distributed

    root = tempfile.mkdtemp(prefix="accelkit-bench-fsdp-", dir=".")
    try:
        results = run_distributed(_job, width, layers, saves, root, world_size=count, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "times": results[0]["times"],
        "bytes_per_process": [r["own_bytes"] for r in results],
    }


def main(quick: bool = False) -> dict[str, Any]:
    """Measure and write ``benchmarks/results/fsdp.json``."""
    width, layers = (1024, 8) if quick else (2048, 24)
    saves, passes = (2, 1) if quick else (3, 3)
    params = width * width * layers
    state_bytes = params * 4 * 3  # fp32 parameters + AdamW's two moments
    samples: dict[int, list[float]] = {n: [] for n in COUNTS}
    per_process: dict[int, list[int]] = {}
    with section(f"sharded save of {state_bytes / MB:.0f} MB on 1, 2, 4 processes"):
        for p in range(passes):
            order = COUNTS[p % len(COUNTS) :] + COUNTS[: p % len(COUNTS)]
            for count in order:
                run = _run(count, width, layers, saves)
                samples[count].extend(run["times"])
                per_process[count] = run["bytes_per_process"]
        rows = []
        results: dict[str, Any] = {"state_bytes": state_bytes, "parameters": params}
        for count in COUNTS:
            seconds = median(samples[count])
            results[str(count)] = {
                "median_s": seconds,
                "samples_s": samples[count],
                "throughput_MBps": state_bytes / seconds / MB,
                "bytes_per_process": per_process[count],
            }
            rows.append([count, seconds, state_bytes / seconds / MB, max(per_process[count]) / MB])
        print_table(rows, ["processes", "save s", "MB/s", "MB per process (max)"])
    ratio = results["4"]["median_s"] / results["1"]["median_s"]
    results["ratio_4_to_1"] = ratio
    target = Target("sharded save time, 4 processes / 1 process", ratio, 1.1, "x", False)
    notes = [
        f"{torch.get_num_threads()} torch threads in this process; the machine has "
        "2 cores, shared by 4 processes at N=4 (and by other jobs).",
        "Each process writes only its share (see bytes_per_process).",
    ]
    write_result("fsdp", results, quick=quick, targets=[target], notes=notes, title="FSDP saves")
    return results


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv[1:])
