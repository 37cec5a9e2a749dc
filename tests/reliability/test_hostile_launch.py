"""`accelkit launch` never orphans its job and never hangs, whatever signals it gets.

Real jobs through the real console script: ``accelkit launch --cpu --num_processes 2`` (torchrun
and two gloo workers saving checkpoints in a loop, or a plain Python script that knows nothing of
accelkit), and one local process run directly. The launcher is SIGKILLed (it can forward nothing:
Linux's parent-death signal must take the job down at every link), torchrun is SIGKILLed (the
workers must not outlive it), and the launcher gets bursts of 200 signals, which used to deadlock
it when a handler re-entered another handler's lock. Every test kills whatever it started in a
``finally``.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.helpers.processes import alive, descendants

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]

ACCELKIT = shutil.which("accelkit", path=os.path.dirname(sys.executable)) or "accelkit"

SAVING_SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    from accelkit import Accelerator, ProjectConfiguration

    out = os.environ["OUT_DIR"]
    config = ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config)
    with open(os.path.join(out, f"pid{accelerator.process_index}"), "w") as f:
        f.write(str(os.getpid()))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    while True:
        accelerator.backward(model(torch.randn(2, 4)).square().sum())
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()
        time.sleep(0.05)
    """
)
# No accelkit, no torch: the guard must not depend on the script using accelkit.
PLAIN_SCRIPT = textwrap.dedent(
    """
    import os, time
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(os.environ["OUT_DIR"], f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)
    """
)


class Job:
    """A real ``accelkit launch`` job in a session of its own (as a shell starts one)."""

    def __init__(self, tmp_path: Path, script: str, processes: int) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        path = tmp_path / "job.py"
        path.write_text(script)
        self.processes = processes
        self.launcher = subprocess.Popen(
            [ACCELKIT, "launch", "--cpu", "--num_processes", str(processes), str(path)],
            env={**os.environ, "OUT_DIR": str(self.out), "HF_HOME": str(tmp_path / "hf")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.seen: set[int] = set()  # every process of the job ever seen, killed in the end

    def watch(self) -> set[int]:
        self.seen |= descendants(self.launcher.pid)
        return self.seen

    def wait_for(self, condition: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self._met(condition):
            self.watch()
            if self.launcher.poll() is not None or time.monotonic() > deadline:
                self.launcher.kill()
                pytest.fail(
                    f"the job never reached {condition!r}:\n{self.launcher.communicate()[0]}"
                )
            time.sleep(0.05)
        self.watch()

    def _met(self, condition: str) -> bool:
        if condition == "workers":
            return all(self._pid_file(rank) for rank in range(self.processes))
        if condition == "child":  # torchrun started (not the reaper, nor a passing helper)
            return any(_is_torchrun(pid) for pid in descendants(self.launcher.pid))
        return bool(self.checkpoints())  # "checkpoint"

    def _pid_file(self, rank: int) -> int | None:
        try:
            return int((self.out / f"pid{rank}").read_text())
        except (OSError, ValueError):
            return None

    def workers(self) -> set[int]:
        return {pid for rank in range(self.processes) if (pid := self._pid_file(rank))}

    def torchrun(self) -> int:
        (child,) = [
            p
            for p in self.watch()
            if Path(f"/proc/{p}/stat").exists()
            and _ppid(p) == self.launcher.pid
            and not _is_reaper(p)
        ]
        return child

    def checkpoints(self) -> list[str]:
        """Committed checkpoints (those with a manifest), by name."""
        folder = self.out / "checkpoints"
        if not folder.is_dir():
            return []
        return sorted(p.parent.name for p in folder.glob("checkpoint_*/accelkit.json"))

    def kill_all(self) -> None:
        # Not the job memory's reaper: it removes /dev/shm's folder once the launcher is gone.
        for pid in {self.launcher.pid, *self.seen, *self.workers()} - set(
            filter(_is_reaper, self.seen)
        ):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.launcher.poll() is None:
            self.launcher.wait(timeout=10)
        if self.launcher.stdout is not None:
            self.launcher.stdout.close()


def _is_torchrun(pid: int) -> bool:
    """Whether ``pid`` is the launcher's torchrun (``python -m accelkit.launch._torchrun``)."""
    try:
        return b"accelkit.launch._torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _is_reaper(pid: int) -> bool:
    """Whether ``pid`` is the reaper of a job's shared memory (``accelkit.launch.job_memory``):
    the launcher's other child."""
    try:
        return b"accelkit-job-" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    started: list[Job] = []
    try:
        yield started
    finally:
        for job in started:
            job.kill_all()


def _start(jobs: list[Job], path: Path, script: str, processes: int = 2) -> Job:
    job = Job(path, script, processes)
    jobs.append(job)
    return job


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    """The pids still running after ``seconds`` (empty once all are gone)."""
    deadline = time.monotonic() + seconds
    while (left := {pid for pid in pids if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_sigkill_of_the_launcher_takes_torchrun_and_the_saving_workers_down(
    tmp_path: Path, jobs: list[Job]
) -> None:
    job = _start(jobs, tmp_path, SAVING_SCRIPT)
    job.wait_for("checkpoint")
    time.sleep(0.5)  # a few saves in: the kill lands inside the save loop
    everything = job.watch() | job.workers()
    assert job.workers() <= everything and len(everything) >= 3, everything  # torchrun + 2

    os.kill(job.launcher.pid, signal.SIGKILL)
    job.launcher.wait(timeout=10)
    assert not _gone_within(everything, 5), "processes of the job outlived the launcher"

    # Nothing is saved after the job is gone, and what was committed is whole.
    committed = job.checkpoints()
    time.sleep(2)
    assert job.checkpoints() == committed
    verify = subprocess.run(
        [ACCELKIT, "ckpt", "verify", str(job.out / "checkpoints" / committed[-1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("processes", [1, 2], ids=["one-process-run-directly", "torchrun"])
def test_sigkill_of_the_launcher_takes_a_script_without_accelkit_down(
    tmp_path: Path, jobs: list[Job], processes: int
) -> None:
    # The guard is armed before the script runs, so it holds for any script.
    job = _start(jobs, tmp_path, PLAIN_SCRIPT, processes)
    job.wait_for("workers")
    everything = job.watch() | job.workers()
    assert len(everything) >= processes

    os.kill(job.launcher.pid, signal.SIGKILL)
    job.launcher.wait(timeout=10)
    assert not _gone_within(everything, 5), "processes of the job outlived the launcher"


def test_sigkill_of_torchrun_takes_the_workers_down(tmp_path: Path, jobs: list[Job]) -> None:
    # The middle link: torchrun killed (the OOM killer's favourite) must not orphan the workers,
    # and the launcher reports it as a shell would (128 + 9).
    job = _start(jobs, tmp_path, SAVING_SCRIPT)
    job.wait_for("checkpoint")
    workers = job.workers()
    os.kill(job.torchrun(), signal.SIGKILL)
    output, _ = job.launcher.communicate(timeout=30)
    assert not _gone_within(workers, 5), "workers outlived torchrun"
    assert job.launcher.returncode == 128 + signal.SIGKILL, output
    committed = job.checkpoints()
    time.sleep(1)
    assert job.checkpoints() == committed


class _Reader:
    """The launcher's output, read line by line in a thread as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        assert process.stdout is not None
        self._thread = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def saw(self, text: str, timeout: float) -> bool:
        """Whether a line holding ``text`` came within ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: any(text in x for x in self.lines), timeout)

    def text(self, join: bool = False) -> str:
        """What was read so far (``join``: all of it, once the launcher closed its output)."""
        if join:
            self._thread.join(timeout=30)
        with self._changed:
            return "".join(self.lines)


def _burst(pid: int, signals: list[int], to_group: bool) -> None:
    # A millisecond apart, so that signals land one by one while the launcher is busy with the
    # previous ones (signals sent all at once merge into one in the kernel and prove little).
    for signum in signals:
        try:
            (os.killpg if to_group else os.kill)(pid, signum)
        except ProcessLookupError:
            return  # it is gone already: the burst ended it
        time.sleep(0.001)


@pytest.mark.parametrize("trial", range(3))
def test_a_burst_of_200_sigterms_ends_the_launch(
    tmp_path: Path, jobs: list[Job], trial: int
) -> None:
    job = _start(jobs, tmp_path, SAVING_SCRIPT)
    job.wait_for("checkpoint")
    everything = job.watch() | job.workers()
    started = time.monotonic()
    _burst(job.launcher.pid, [signal.SIGTERM] * 200, to_group=False)
    output, _ = job.launcher.communicate(timeout=45)  # within the 40 s grace, never a hang
    assert job.launcher.returncode == 128 + signal.SIGTERM, output
    assert time.monotonic() - started < 40
    assert "Traceback" not in output and "stopped by SIGTERM; exit code 143" in output, output
    # Linux merges signals that arrive before the first is handled, so the launcher sees one or
    # more: one line for the first, at most one for a second; the rest change nothing.
    assert output.count("SIGTERM again") <= 1, output
    assert output.count("accelkit launch:") <= 3, output
    assert not _gone_within(everything, 5)


@pytest.mark.parametrize("to_group", [False, True], ids=["to-pid", "to-group-like-ctrl-c"])
def test_a_mixed_burst_ends_with_the_first_signal(
    tmp_path: Path, jobs: list[Job], to_group: bool
) -> None:
    job = _start(jobs, tmp_path, PLAIN_SCRIPT)
    job.wait_for("workers")
    everything = job.watch() | job.workers()
    rng = random.Random(trial_seed := random.randrange(2**31))
    others = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    signals = [rng.choice(others) for _ in range(199)]
    # The first signal, then the burst once the launcher has taken it: two signals pending at
    # once reach a process in the order of their numbers (the kernel's, then Python's handlers),
    # not in the order they were sent, so on a loaded machine a SIGHUP sent a millisecond after
    # the SIGINT could be the one handled first (seen once in a rehearsal). Which one came first
    # is only known once the launcher said so.
    reader = _Reader(job.launcher)
    _burst(job.launcher.pid, [signal.SIGINT], to_group)
    assert reader.saw("SIGINT: stopping", timeout=30), (trial_seed, reader.text())
    _burst(job.launcher.pid, signals, to_group)
    job.launcher.wait(timeout=45)
    output = reader.text(join=True)
    assert job.launcher.returncode == 128 + signal.SIGINT, (trial_seed, output)
    assert "Traceback" not in output and "stopped by SIGINT" in output, (trial_seed, output)
    assert not _gone_within(everything, 5)


def test_a_burst_while_torchrun_starts_ends_the_launch(tmp_path: Path, jobs: list[Job]) -> None:
    # Another order: the signals land before any worker exists (torchrun is still importing
    # torch); workers that torchrun was about to start must not survive either.
    job = _start(jobs, tmp_path, PLAIN_SCRIPT)
    job.wait_for("child")
    _burst(job.launcher.pid, [signal.SIGTERM] * 200, to_group=False)
    output, _ = job.launcher.communicate(timeout=45)
    assert job.launcher.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output, output
    time.sleep(1)  # a worker forked at the last moment has had time to write its pid
    assert not _gone_within(job.seen | job.workers(), 5)
