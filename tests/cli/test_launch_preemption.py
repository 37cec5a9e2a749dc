"""`accelkit launch` passes a preemption's exit code through (issue 25): a worker that got the
signal itself, saved and exited with ``preemption_exit_code`` ends the job with that code and one
line that says so, not a failure report. SIGUSR1 to the launcher (SLURM's ``--signal=B:USR1``),
or to every process of the job (without ``B:``), reaches every worker; ``--max_restarts`` does
not restart a preempted group; the record the workers leave for the launcher is untrusted input.
(SIGTERM to the launcher, forwarded to the workers, is in ``tests/examples/test_slurm.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.examples.runner import OFFLINE_ENV, accelkit_command
from tests.helpers.processes import descendants

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "preemption_job.py"


def _env() -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _steps(progress: Path) -> int:
    """The steps the job's rank 0 reported (0 before the first)."""
    try:
        text = progress.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [0, 2], ids=["no-restarts", "max_restarts-2"])
def test_a_worker_preempted_by_its_own_signal_ends_the_job_with_its_exit_code(
    tmp_path: Path, restarts: int
) -> None:
    # With --max_restarts 2 the group that exited for the preemption is not restarted (a
    # restart would run the job on after its checkpoint): one checkpoint, exit 75 at once.
    project = tmp_path / "run"
    job = [str(JOB), str(project), "--total", "12", "--where", "backward", "--signal_at", "4"]
    job += ["--signal_rank", "1", "--step_sleep", "0.05"]
    flags = ["--max_restarts", str(restarts)] if restarts else []
    result = subprocess.run(
        [*accelkit_command(), "launch", "--cpu", "--num_processes", "2", *flags, *job],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 75, output[-4000:]
    if restarts:
        assert f"not restarting them ({restarts} restart(s) left unused)" in output, output
    assert "will restart worker group" not in output
    assert "the job stopped for a preemption after saving its checkpoint; exit code 75" in output
    assert "ChildFailedError" not in output and "Root Cause" not in output
    assert "accelkit: SIGUSR1 received: saved a preemption checkpoint at optimizer step" in output
    (manifest,) = [json.loads(p.read_text()) for p in project.glob("checkpoints/*/accelkit.json")]
    assert manifest["reason"] == "preemption" and manifest["step"] in (5, 6)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["launcher", "job-step"])
def test_sigusr1_reaches_every_worker_and_ends_in_one_checkpoint(tmp_path: Path, to: str) -> None:
    """``launcher``: SLURM's ``--signal=B:USR1@120`` with the launcher as the batch step (no
    trap needed); ``job-step``: without ``B:``, SLURM signals every process of the step:
    the launcher, torchrun's agent (which must survive it) and the workers."""
    project, progress = tmp_path / "run", tmp_path / "progress"
    job = [str(JOB), str(project), "--total", "400", "--step_sleep", "0.05"]
    job += ["--progress", str(progress)]
    launcher = subprocess.Popen(
        [*accelkit_command(), "launch", "--cpu", "--num_processes", "2", *job],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while launcher.poll() is None and time.monotonic() < deadline:
            if _steps(progress) >= 3:
                break
            time.sleep(0.05)
        assert launcher.poll() is None, launcher.communicate()[0][-4000:]
        targets = [launcher.pid, *(descendants(launcher.pid) if to == "job-step" else ())]
        for pid in targets:
            os.kill(pid, signal.SIGUSR1)
        output, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 75, output[-4000:]
    assert "SIGUSR1: forwarded to 2 worker process(es)" in output, output[-4000:]
    assert "accelkit: SIGUSR1 received: saved a preemption checkpoint" in output
    assert "the job stopped for a preemption after saving its checkpoint; exit code 75" in output
    (manifest,) = [json.loads(p.read_text()) for p in project.glob("checkpoints/*/accelkit.json")]
    assert manifest["reason"] == "preemption" and manifest["step"] >= 3


# A worker that plants what it likes where the launcher reads the record, then exits with the
# code of its choice: on a restart (TORCHELASTIC_RESTART_COUNT > 0), it succeeds.
_PLANTER = r"""
import json, os, sys
plant, code = sys.argv[1], int(sys.argv[2])
path, job = os.environ["ACCELKIT_PREEMPTION_FILE"], os.environ["ACCELKIT_PREEMPTION_JOB"]
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    sys.exit(0)
if os.environ.get("LOCAL_RANK", "0") == "0":
    good = {"exit_code": 75, "job": job}
    if plant == "valid":
        open(path, "w").write(json.dumps(good))
    elif plant == "symlink":
        open(path + ".real", "w").write(json.dumps(good))
        os.symlink(path + ".real", path)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "huge":
        open(path, "w").write(json.dumps({**good, "pad": "x" * (1 << 21)}))
    elif plant == "garbage":
        open(path, "wb").write(b"\x00{exit_code: 75")
    elif plant == "other-job":
        open(path, "w").write(json.dumps({**good, "job": "another"}))
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plant", "code", "processes", "restarts", "expected"),
    [
        # A real failure stays a failure, whatever record is there (and is restarted).
        ("valid", 1, 1, 0, 1),
        ("valid", 1, 2, 1, 0),
        # A record that is not this job's own regular file is not read as one.
        ("symlink", 75, 2, 1, 0),
        ("fifo", 75, 2, 1, 0),
        ("huge", 75, 1, 0, 75),
        ("garbage", 75, 1, 0, 75),
        ("other-job", 75, 2, 1, 0),
    ],
    ids=[
        "crash+record",
        "crash+record-restarted",
        "symlink",
        "fifo",
        "huge",
        "garbage",
        "other-job",
    ],
)
def test_a_planted_exit_record_never_hangs_the_launcher_nor_hides_a_failure(
    tmp_path: Path, plant: str, code: int, processes: int, restarts: int, expected: int
) -> None:
    # With --max_restarts 1, a group whose record is refused is restarted (and then succeeds):
    # the planted record did not stop torchrun's restarts either.
    script = tmp_path / "planter.py"
    script.write_text(_PLANTER)
    flags = ["--num_processes", str(processes), "--max_restarts", str(restarts)]
    started = time.monotonic()
    result = subprocess.run(
        [*accelkit_command(), "launch", "--cpu", *flags, str(script), plant, str(code)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == expected, output[-4000:]
    assert "preemption" not in output, output[-4000:]
    assert time.monotonic() - started < 120
