"""`accelkit launch` passes a preemption's exit code through (issue 25): a worker that got the
signal itself, saved and exited with ``preemption_exit_code`` ends the job with that code and one
line that says so, not a failure report. (SIGTERM to the launcher, forwarded to the workers, is
in ``tests/examples/test_slurm.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.examples.runner import OFFLINE_ENV, accelkit_command

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "preemption_job.py"


@pytest.mark.slow
def test_a_worker_preempted_by_its_own_signal_ends_the_job_with_its_exit_code(
    tmp_path: Path,
) -> None:
    project = tmp_path / "run"
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    job = [str(JOB), str(project), "--total", "12", "--where", "backward", "--signal_at", "4"]
    job += ["--signal_rank", "1", "--step_sleep", "0.05"]
    result = subprocess.run(
        [*accelkit_command(), "launch", "--cpu", "--num_processes", "2", *job],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 75, output[-4000:]
    assert "the job stopped for a preemption after saving its checkpoint; exit code 75" in output
    assert "ChildFailedError" not in output and "Root Cause" not in output
    assert "accelkit: SIGUSR1 received: saved a preemption checkpoint at optimizer step" in output
    (manifest,) = [json.loads(p.read_text()) for p in project.glob("checkpoints/*/accelkit.json")]
    assert manifest["reason"] == "preemption" and manifest["step"] in (5, 6)
