"""The memory tier (#39): restoring a snapshot from the job's shared memory against restoring the
same state from the local disk tier, and what a snapshot costs the training step.

One process, on the CPU, a model + AdamW state of about 1 GiB (``--quick``: 64 MiB):

- **restore**: ``load_state()`` of the memory snapshot (``/dev/shm``, what a restarted group
  reads) against ``load_state()`` of a checkpoint of the same state on the local disk, with a
  cold page cache (``os.sync()`` + ``drop_caches``, needs root; else warm, said in the notes),
  alternating, medians. Target (#39): memory <= 1/5 of the cold disk.
- **snapshot**: how long the step is blocked while a snapshot is taken (the host copy of the
  asynchronous save, at the save point) and how long the whole snapshot takes (written and
  committed in the background); the cost at one snapshot per 30 s of training is the blocked
  time over 30 s (target <= 1%), and the whole time over 30 s bounds the CPU the background
  writing takes from the step.

``ACCELKIT_MEMORY_DIR`` is set to a scratch folder in ``/dev/shm``, as ``accelkit launch`` does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    Target,
    drop_page_cache,
    gb,
    median,
    print_table,
    rmtree,
    scratch_dir,
    section,
    write_result,
)

SNAPSHOT_INTERVAL_S = 30.0


def _model(total_bytes: int) -> nn.Module:
    # AdamW keeps two more copies of every parameter: params * 4 bytes * 3 = total_bytes.
    params = total_bytes // 12
    width = 2048
    layers = max(1, params // (width * width))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    out = model(torch.randn(4, model[0].in_features)).square().mean()
    out.backward()
    optimizer.step()
    optimizer.zero_grad()


def main(quick: bool = False) -> dict[str, Any]:
    from accelkit import Accelerator
    from accelkit.runtime.job_memory import ENV_MEMORY_DIR
    from accelkit.utils import ProjectConfiguration

    size = (64 if quick else 1024) * 2**20
    rounds = 2 if quick else 5
    shm = tempfile.mkdtemp(prefix="accelkit-bench-memory-", dir="/dev/shm")
    disk = scratch_dir("memory")
    os.environ[ENV_MEMORY_DIR] = shm
    notes: list[str] = []
    try:
        accelerator = Accelerator(
            cpu=True,
            project_config=ProjectConfiguration(
                project_dir=str(disk),
                automatic_checkpoint_naming=True,
                memory_snapshot_every_steps=10**9,  # taken by hand below
            ),
        )
        model = _model(size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        _one_step(model, optimizer)
        state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
        checkpointing = accelerator._checkpointing  # the part the boundary hook calls
        tier = accelerator._checkpoints.memory

        with section(f"snapshot ({gb(state_bytes):.2f} GB of model + AdamW state)"):
            blocked, whole = [], []
            for _ in range(rounds):
                _one_step(model, optimizer)  # each snapshot of its own step
                steps = accelerator.gradient_state.optimizer_steps
                start = time.perf_counter()
                handle = checkpointing.save_snapshot(tier.snapshot_path(steps), None)
                blocked.append(time.perf_counter() - start)
                handle.result()
                whole.append(time.perf_counter() - start)
                tier.prune(keep=handle.path)
            snapshot_path = handle.path
            print_table(
                [["blocked (host copy)", median(blocked)], ["whole (committed)", median(whole)]],
                ["snapshot", "seconds"],
            )

        with section("restore: memory snapshot against the local disk"):
            disk_path = accelerator.save_state()
            cold, why = drop_page_cache()
            notes.append(why)
            memory_s, disk_s = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                accelerator.load_state(snapshot_path)
                memory_s.append(time.perf_counter() - start)
                if cold:
                    drop_page_cache()
                start = time.perf_counter()
                accelerator.load_state(disk_path)
                disk_s.append(time.perf_counter() - start)
            ratio = median(memory_s) / median(disk_s)
            print_table(
                [
                    ["memory snapshot", median(memory_s)],
                    [f"local disk ({'cold' if cold else 'warm'})", median(disk_s)],
                    ["memory / disk", ratio],
                ],
                ["restore", "seconds"],
            )
        accelerator.end_training()
    finally:
        os.environ.pop(ENV_MEMORY_DIR, None)
        shutil.rmtree(shm, ignore_errors=True)
        rmtree(disk)

    overhead = median(blocked) / SNAPSHOT_INTERVAL_S * 100
    background = median(whole) / SNAPSHOT_INTERVAL_S * 100
    targets = [
        Target(
            "restore from memory / from the local disk (cold)",
            ratio,
            0.2,
            unit="x",
            higher_is_better=False,
            reason=(
                ""
                if ratio <= 0.2
                else f"the disk read {gb(state_bytes) / median(disk_s):.1f} GB/s after "
                "drop_caches: a virtual disk its host caches is not cold; the memory restore "
                "is bound by the checksum (xxh3, ~5-10 GB/s) and the copy into the model"
            ),
        ),
        Target(
            "step blocked by one snapshot per 30 s",
            overhead,
            1.0,
            unit="%",
            higher_is_better=False,
        ),
    ]
    results = {
        "state_bytes": state_bytes,
        "snapshot_blocked_s": blocked,
        "snapshot_whole_s": whole,
        "restore_memory_s": memory_s,
        "restore_disk_s": disk_s,
        "disk_cold": cold,
        "background_share_at_30s_pct": background,
    }
    notes.append(
        f"the background writing of one snapshot per 30 s uses at most {background:.2f}% of "
        "the time (it shares the cores with the step)"
    )
    write_result(
        "memory",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Memory tier: restore and snapshot cost",
    )
    return results


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
