"""A 2-process run that did all its work exits 0: no "terminate called" from gloo at exit.

A gloo worker thread that still had to take the GIL when the interpreter began to finalize
aborted the process (see accelkit.runtime.teardown); CI saw it about once per full run, in a
different multi-process test each time. The script below is a plain training-loop ending
(DistributedDataParallel, gather_for_metrics, wait_for_everyone) whose only twist is a long
switch interval, which widens the window in which the main thread keeps the GIL. It runs both
ways a script gets its process group: accelkit creates it, or the script does (as Accelerate
scripts that call ``init_process_group`` themselves do). Against the old exit, 12 of 48 runs
aborted (both kinds), and every one of 7 runs of this test failed; with the exit hook, 0 of 68
runs aborted. Four runs of each kind, two at a time.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.examples.runner import OFFLINE_ENV, accelkit_command
from tests.helpers.processes import finish

SCRIPT = """
import sys

sys.setswitchinterval(0.5)  # the main thread keeps the GIL up to 0.5 s after a worker asks

import torch
from accelkit import Accelerator

if sys.argv[1] == "own-group":
    torch.distributed.init_process_group("gloo")
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(2, 2))
for _ in range(5):
    accelerator.gather_for_metrics(torch.ones(1000))
accelerator.wait_for_everyone()
open(f"finished_{accelerator.process_index}", "w").close()
"""

RUNS = ["accelkit-group", "own-group"] * 4
AT_ONCE = 2


def test_runs_that_finished_exit_zero(tmp_path: Path) -> None:
    script = tmp_path / "finish.py"
    script.write_text(SCRIPT)
    launch = [*accelkit_command(), "launch", "--cpu", "--num_processes", "2", str(script)]
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    failures: list[str] = []
    for first in range(0, len(RUNS), AT_ONCE):
        runs = list(enumerate(RUNS))[first : first + AT_ONCE]
        jobs = []
        for number, kind in runs:
            folder = tmp_path / f"run_{number}"
            folder.mkdir()
            job = subprocess.Popen(
                [*launch, kind],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            jobs.append((kind, folder, job))
        for kind, folder, job in jobs:
            returncode, output, _ = finish(job, timeout=240)
            finished = sorted(p.name for p in folder.glob("finished_*"))
            assert finished == ["finished_0", "finished_1"], f"{kind}:\n{output[-4000:]}"
            if returncode != 0:
                failures.append(f"{kind} (exit {returncode}):\n{output[-4000:]}")
    assert not failures, f"{len(failures)} of {len(RUNS)} runs failed at exit:\n" + "\n".join(
        failures
    )
