"""Stopping `accelkit launch` with a signal stops the whole job, quietly, checkpoints intact.

Each test starts a real 2-process CPU job (torchrun, two gloo workers saving checkpoints in a
loop), signals the launcher the way a scheduler (SIGTERM to its pid), ``kill -INT`` (SIGINT to its
pid) or a terminal's Ctrl-C (SIGINT to its process group) does, and checks what a user sees: the
exit code, a few lines without a traceback, no process of the job left, and the last committed
checkpoint loading with ``Accelerator.load_state``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from tests.helpers.processes import alive, descendants

TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, time
    import torch
    from accelkit import Accelerator, ProjectConfiguration

    if os.environ.get("IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.environ["OUT_DIR"]
    config = ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(project_config=config)
    with open(os.path.join(out, f"pid{accelerator.process_index}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    while True:
        accelerator.backward(model(torch.randn(2, 4)).square().sum())
        optimizer.step()
        optimizer.zero_grad()
        path = accelerator.save_state()
        if accelerator.is_main_process:  # the checkpoint is committed: record what it holds
            weight = accelerator.unwrap_model(model).weight.tolist()
            with open(os.path.join(out, "committed.tmp"), "w") as f:
                json.dump({"path": path, "weight": weight}, f)
            os.replace(os.path.join(out, "committed.tmp"), os.path.join(out, "committed.json"))
        time.sleep(0.05)
    """
)


def _start_job(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[str], set[int]]:
    """Launch the job in a session of its own (as a shell starts a foreground job) and wait for
    its first committed checkpoint; return the launcher and every process of the job."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accelkit.cli.main",
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            script,
        ],
        env={**os.environ, "OUT_DIR": str(out), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "committed.json").exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(f"the job did not commit a checkpoint:\n{launcher.communicate()[0]}")
        time.sleep(0.1)
    time.sleep(0.3)  # let the signal land in the middle of the save loop
    job = descendants(launcher.pid)
    workers = {int((out / f"pid{rank}").read_text()) for rank in range(2)}
    assert workers <= job, (workers, job)
    return launcher, job


def _assert_job_gone(job: set[int]) -> None:
    deadline = time.monotonic() + 5
    while {pid for pid in job if alive(pid)} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {pid for pid in job if alive(pid)}, "processes of the job are still running"


def _assert_checkpoint_loads(out: Path) -> None:
    committed = json.loads((out / "committed.json").read_text())
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    newest = accelerator.load_state()  # the newest committed checkpoint, whatever the kill left
    assert int(newest.rsplit("_", 1)[1]) >= int(committed["path"].rsplit("_", 1)[1])
    assert accelerator.load_state(committed["path"]) == committed["path"]
    assert model.weight.tolist() == committed["weight"]


@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["SIGTERM-to-pid", "SIGINT-to-pid", "SIGINT-to-group-like-ctrl-c"],
)
def test_signal_stops_every_worker(tmp_path: Path, signum: int, to_group: bool) -> None:
    launcher, job = _start_job(tmp_path)
    if to_group:
        os.killpg(launcher.pid, signum)
    else:
        os.kill(launcher.pid, signum)
    output, _ = launcher.communicate(timeout=60)

    assert launcher.returncode == 128 + signum, output
    name = signal.Signals(signum).name
    assert f"stopped by {name}; exit code {128 + signum}" in output
    assert "Traceback" not in output and "Error" not in output, output
    # The launcher's two lines, torchrun's line and at most one per worker ("Sending process N
    # closing signal SIGTERM", for a worker still running when torchrun stops them: the
    # launcher sends every worker SIGTERM first); nothing more.
    assert len(output.strip().splitlines()) <= 6, output
    assert output.count("closing signal SIGTERM") <= 2, output
    _assert_job_gone(job)
    _assert_checkpoint_loads(tmp_path / "out")


def test_second_signal_kills_workers_that_ignore_sigterm(tmp_path: Path) -> None:
    launcher, job = _start_job(tmp_path, IGNORE_SIGTERM="1")
    os.killpg(launcher.pid, signal.SIGINT)
    time.sleep(1.0)
    assert launcher.poll() is None, "the workers ignore SIGTERM: the launcher should still wait"
    os.killpg(launcher.pid, signal.SIGINT)
    output, _ = launcher.communicate(timeout=30)

    assert launcher.returncode == 128 + signal.SIGINT, output
    assert "SIGINT again: killing" in output
    assert "Traceback" not in output, output
    _assert_job_gone(job)
    _assert_checkpoint_loads(tmp_path / "out")


def test_single_process_script_is_stopped_too(tmp_path: Path) -> None:
    # One local process runs the script directly (no torchrun): the same stop applies.
    script = tmp_path / "loop.py"
    script.write_text(
        "import os, sys, time\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    pid_file = tmp_path / "pid"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accelkit.cli.main", "launch", "--cpu", script, pid_file],
        env={**os.environ, "HF_HOME": str(tmp_path / "hf_home")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    os.killpg(launcher.pid, signal.SIGINT)
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGINT, output
    assert "Traceback" not in output and "stopped by SIGINT" in output, output
    _assert_job_gone({int(pid_file.read_text())})
