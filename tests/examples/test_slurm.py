"""examples/slurm: the per-node launcher, run as two "nodes" on this machine (1 process each);
the preemptible job under a real SIGUSR1 to every process of its job step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.examples.runner import EXAMPLES, OFFLINE_ENV, accelkit_command
from tests.helpers.distributed import free_port
from tests.helpers.processes import descendants


def test_launch_node_script_joins_two_machines(tmp_path: Path) -> None:
    project = tmp_path / "run"
    port = free_port()
    nodes = []
    for node in (0, 1):
        env = {
            **os.environ,
            **OFFLINE_ENV,
            # What SLURM and train.sbatch would set on each node.
            "SLURM_NNODES": "2",
            "SLURM_NODEID": str(node),
            "MAIN_PROCESS_IP": "127.0.0.1",
            "MAIN_PROCESS_PORT": str(port),
            "PROCS_PER_NODE": "1",
            "LAUNCH_FLAGS": "--cpu",
            "ACCELKIT": " ".join(accelkit_command()),
        }
        command = [
            "bash",
            str(EXAMPLES / "slurm" / "launch_node.sh"),
            str(EXAMPLES / "quickstart.py"),
            "--project_dir",
            str(project),
            "--epochs",
            "1",
            "--samples",
            "128",
            "--batch_size",
            "16",
        ]
        nodes.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for process in nodes:
        out, _ = process.communicate(timeout=240)
        outputs.append(out)
    assert [p.returncode for p in nodes] == [0, 0], "\n\n".join(o[-4000:] for o in outputs)

    # One run of 2 processes on 2 "machines": a single checkpoint, written by both ranks.
    manifest = json.loads((project / "checkpoints" / "checkpoint_0" / "accelkit.json").read_text())
    assert manifest["world_size"] == 2
    files = {f["path"] for f in manifest["files"]}
    assert {"random_states_0.safetensors", "random_states_1.safetensors"} <= files
    # Each machine's local main process prints (accelerator.print is once per machine).
    assert all("epoch 1: mean loss" in out for out in outputs)


def test_sbatch_script_is_valid_bash_and_launches_every_node() -> None:
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm" / "train.sbatch")], check=True)
    assert "#SBATCH --nodes=" in script
    assert "srun" in script and "launch_node.sh" in script


def _committed(project: Path) -> list[dict[str, object]]:
    root = project / "checkpoints"
    if not root.is_dir():
        return []
    found = [json.loads(m.read_text()) for m in root.glob("checkpoint_*/accelkit.json")]
    return sorted(found, key=lambda m: int(str(m["iteration"])))


def test_preemptible_job_saves_on_slurms_signal_requeues_and_resumes(tmp_path: Path) -> None:
    """preemptible.sbatch run by bash, as SLURM runs it (not sbatch): SIGUSR1 to every process
    of the job step, not to the batch shell (what ``--signal=USR1@120`` sends: the launcher,
    torchrun and the workers), with no trap in the script, ends in a committed preemption
    checkpoint, the launcher's exit code 75 and the requeue branch; the job started again
    resumes there."""
    project = tmp_path / "run"
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "ACCELKIT": " ".join(accelkit_command()),
        "LAUNCH_FLAGS": "--cpu",
        "NUM_PROCESSES": "2",
        "PROJECT_DIR": str(project),
    }
    env.pop("SLURM_JOB_ID", None)  # no scontrol here
    script = str(EXAMPLES / "slurm" / "preemptible.sbatch")
    flags = ["--save_every_steps", "10", "--save_every_seconds", "3600"]
    job = subprocess.Popen(
        ["bash", script, "--steps", "2000", "--step_sleep", "0.02", *flags],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _committed(project) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        assert _committed(project), "the job made no interval checkpoint"
        for pid in descendants(job.pid):  # the job step: everything below the batch shell
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    assert "exit code 75" in out and "requeueing" in out, out[-4000:]
    manifests = _committed(project)
    assert manifests[-1]["reason"] == "preemption"
    assert {m["reason"] for m in manifests[:-1]} == {"interval"}
    stopped_at = int(str(manifests[-1]["step"]))
    assert 10 <= stopped_at < 2000
    verify = subprocess.run(
        [*accelkit_command(), "ckpt", "verify", str(project)], env=env, capture_output=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    final = stopped_at + 5
    again = subprocess.run(
        ["bash", script, "--steps", str(final), *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert f"resumed at step {stopped_at}" in again.stdout
    assert f"done: {final} steps" in again.stdout
    assert int(str(_committed(project)[-1]["step"])) == final
