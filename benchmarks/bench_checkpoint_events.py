"""What experiment continuity adds to a save: the trackers' side of ``save_state``.

Two accelkit ``Accelerator`` objects in one process, each with the jsonl and TensorBoard
trackers started and the same small model, save into their own project folders in alternating
order: one with ``checkpoint_events`` and the run references recorded (the default), one with
``checkpoint_events=False`` and no trackers (so no references either). The difference of the
median save times is what the trackers' side costs a synchronous save; it is below the noise
of a durable save on a shared machine, so the benchmark also times, call by call, the two
things the training thread does for the trackers during a save: reading the run references for
the manifest (``ExperimentLink.checkpoint_record``) and queueing the save event
(``TrackerHub.event``). The target (issue #20) is that those add under 1 ms to a save.

Usage::

    python -m benchmarks.bench_checkpoint_events [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Target,
    alternate,
    median,
    print_table,
    rmtree,
    scratch_dir,
    section,
    write_result,
)


def _accelerator(root: Path, with_trackers: bool) -> Any:
    from accelkit import Accelerator, ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=str(root),
        automatic_checkpoint_naming=True,
        total_limit=2,
        checkpoint_events=with_trackers,
    )
    accelerator = Accelerator(
        log_with=["jsonl", "tensorboard"] if with_trackers else None, project_config=config
    )
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator.prepare(model, optimizer)
    if with_trackers:
        accelerator.init_trackers("run")
        accelerator.log({"loss": 1.0}, step=0)
        accelerator.get_tracker("jsonl")  # the runs are open before the first save
    return accelerator


def _time_calls(function: Any, calls: int) -> float:
    """Median seconds of one call over ``calls`` calls, each timed alone."""
    samples = []
    for _ in range(calls):
        begin = time.perf_counter_ns()
        function()
        samples.append(time.perf_counter_ns() - begin)
    return median(samples) / 1e9


def main(quick: bool = False) -> None:
    """Measure, print a table, and write ``benchmarks/results/checkpoint_events.json``."""
    from accelkit.trackers.events import CheckpointEvent

    rounds, calls = (8, 200) if quick else (40, 2000)
    scratch = scratch_dir("checkpoint-events")
    try:
        with_trackers = _accelerator(scratch / "with", True)
        without = _accelerator(scratch / "without", False)
        cases = {
            "save, trackers + events": with_trackers.save_state,
            "save, no trackers": without.save_state,
        }
        with section(f"synchronous save_state, {rounds} rounds, alternating"):
            samples = alternate(cases, rounds, measure_memory=False, warmup=True)
        saves = {name: median([s.seconds for s in runs]) for name, runs in samples.items()}
        link = with_trackers._checkpoints.listener
        hub = with_trackers._trackers
        event = CheckpointEvent("save", 0, str(scratch / "x"), 0, {"checkpoint/bytes": 1.0})
        record_s = _time_calls(link.checkpoint_record, calls)
        event_s = _time_calls(lambda: hub.event(event), calls)
        with_trackers.end_training()
        without.end_training()
    finally:
        rmtree(scratch)
    added = saves["save, trackers + events"] - saves["save, no trackers"]
    rows = [[name, value * 1e3] for name, value in saves.items()]
    rows.append(["difference (noise-bound)", added * 1e3])
    print_table(rows, ["case", "median ms"])
    direct_us = (record_s + event_s) * 1e6
    print_table(
        [["checkpoint_record()", record_s * 1e6], ["hub.event()", event_s * 1e6]],
        ["training-thread work per save", "median us"],
    )
    results = {
        "save_median_ms": {name: value * 1e3 for name, value in saves.items()},
        "save_difference_ms": added * 1e3,
        "record_us": record_s * 1e6,
        "event_us": event_s * 1e6,
        "rounds": rounds,
        "calls": calls,
        "cpu_count": os.cpu_count(),
    }
    targets = [
        Target("trackers' work on the training thread per save", direct_us, 1000.0, "us", False)
    ]
    notes = [
        "The save-time difference is a difference of two noisy medians of durable saves "
        "(fsync); the per-call figures are what the training thread itself spends.",
    ]
    path = write_result(
        "checkpoint_events",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Checkpoint events and run references",
    )
    print(f"\ntrackers' work per save: {direct_us:.1f} us (target < 1000 us); wrote {path}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    main()
