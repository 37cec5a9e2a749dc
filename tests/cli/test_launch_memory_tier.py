"""The memory tier under `accelkit launch` (#39): a worker SIGKILLed mid-run, the group restarted
by ``--max_restarts``, and the restart resuming from the snapshots in the job's shared memory,
bit for bit; and the job's shared memory gone when the job ends, however it ends (success, a
failure, the launcher SIGKILLed). Real launches of gloo processes on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from accelkit.checkpointing.memory.tier import project_key
from tests.examples.runner import accelkit_command

ROOT = Path(__file__).resolve().parents[2]

# Trains 20 optimizer steps with a snapshot every 4. In "kill" mode rank 1 of the first attempt
# SIGKILLs itself after step 11 (once the snapshot of step 8 is committed on both ranks; the
# soak, tests/reliability/soak_memory.py, picks the step and rank, and kills without waiting); every
# attempt starts with load_state() when there is anything to resume from. Rank 0 records what it
# loaded, a digest of the final weights and optimizer state, and the job's memory folder. In
# "hang" mode rank 1 of the first attempt stops after step 11 (hang_timeout_seconds=3).
JOB = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys, time
    import torch
    from accelkit import Accelerator
    from accelkit.checkpointing.errors import CheckpointPathError
    from accelkit.utils import ProjectConfiguration, set_seed

    out, mode, project = sys.argv[1], sys.argv[2], sys.argv[3]
    kill_at, kill_rank = (int(a) for a in (sys.argv[4:6] or (11, 1)))
    settle = sys.argv[6:7] != ["nowait"]  # let the newest snapshot commit before the kill
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    memory = os.environ.get("ACCELKIT_MEMORY_DIR", "")
    if mode == "sleep":  # the launcher is SIGKILLed meanwhile
        with open(out, "w") as f:
            json.dump({"memory": memory}, f)
        open(os.path.join(memory, "something"), "w").write("x")
        signal.pause()
    if mode == "fail":
        with open(out, "w") as f:
            json.dump({"memory": memory}, f)
        sys.exit(3)
    set_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, memory_snapshot_every_steps=4
        ),
        hang_timeout_seconds=3 if mode == "hang" else None,
    )
    width = int(os.environ.get("MEMORY_JOB_WIDTH", "16"))  # the soak's state: 12 * 8 * width bytes
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Dropout(0.2), torch.nn.Linear(width, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(512, 6), torch.randn(512, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loaded = None
    try:
        loaded = accelerator.load_state()
    except CheckpointPathError:  # nothing to resume from: a fresh start
        pass
    gs = accelerator.gradient_state
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if gs.optimizer_steps == 5:
            accelerator.save_state()
        if mode == "kill" and attempt == 0 and gs.optimizer_steps == kill_at:
            if settle:
                accelerator.wait_for_checkpoints()  # the snapshot of step 8, committed
                accelerator.wait_for_everyone()
            if accelerator.process_index == kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang" and attempt == 0 and gs.optimizer_steps == 11:
            accelerator.wait_for_checkpoints()  # the snapshot of step 8, committed
            if accelerator.process_index == 1:
                time.sleep(600)  # rank 0 waits in the next gradient all-reduce
        if gs.optimizer_steps == 20:
            break
    accelerator.wait_for_checkpoints()
    digest = hashlib.sha256()
    for tensor in [*model.state_dict().values(), torch.get_rng_state()]:
        digest.update(tensor.detach().numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            digest.update(torch.as_tensor(value).numpy().tobytes())
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"attempt": attempt, "loaded": loaded, "digest": digest.hexdigest(),
                       "memory": memory}, f)
    accelerator.end_training()
    """
)


@pytest.fixture(autouse=True)
def _no_user_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A config file in the developer's own ~/.cache/huggingface must not change these launches.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def launch_args(script: Path, *args: str, processes: int = 2, restarts: int = 0) -> list[str]:
    """``accelkit launch --cpu`` of ``script`` (the soak, tests/reliability/soak_memory.py,
    uses it too)."""
    return [
        *accelkit_command(),
        "launch",
        "--cpu",
        f"--num_processes={processes}",
        f"--max_restarts={restarts}",
        str(script),
        *args,
    ]


def _run(
    tmp_path: Path, name: str, mode: str, restarts: int, project: Path | None = None
) -> tuple[dict[str, str], str]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / f"{name}.json"
    project = project if project is not None else tmp_path / name
    proc = subprocess.run(
        launch_args(script, str(out), mode, str(project), restarts=restarts),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the job ends with when nothing happens to it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        got, _ = _run(tmp_path_factory.mktemp("reference"), "plain", "plain", restarts=0)
    assert got["loaded"] is None
    assert not os.path.exists(got["memory"])
    return got


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_a_restarted_group_resumes_from_memory_bit_for_bit(
    tmp_path: Path, reference: dict[str, str], mode: str
) -> None:
    # kill: rank 1 SIGKILLed after step 11. hang: rank 1 stops after step 11, the watchdog
    # stops the job (exit 75 on both ranks) and the launcher restarts the group in place.
    got, stderr = _run(tmp_path, mode, mode, restarts=1)
    # The second attempt finished, from rank 0's snapshot of step 8 (newer than checkpoint_0
    # of step 5), in the job's shared memory, which is gone now.
    assert got["attempt"] == 1
    project = project_key(str(tmp_path / mode))
    assert got["loaded"] == os.path.join(got["memory"], project, "rank_0", "snapshot_8")
    assert "restored the memory snapshot of step 8 (newer than step 5 on disk)" in stderr
    assert not os.path.exists(got["memory"])
    if mode == "hang":
        assert "restarting them (1 restart(s) left)" in stderr
    # Weights, optimizer state and the torch generator: as if nothing had happened.
    assert got["digest"] == reference["digest"]
    assert got["memory"] != reference["memory"]  # each job its own


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_a_failed_job_commits_its_newest_snapshot_and_the_next_job_resumes_bit_for_bit(
    tmp_path: Path, reference: dict[str, str], mode: str
) -> None:
    # No restart left: the job fails (rank 1 SIGKILLed, or stopped by the watchdog: exit 75)
    # and its shared memory goes with it. The launcher first commits the snapshot of step 8,
    # newer than checkpoint_0 of step 5, as checkpoint_1; the requeued job resumes from it.
    script = tmp_path / "job.py"
    script.write_text(JOB)
    project = tmp_path / "p"
    failed = subprocess.run(
        launch_args(script, str(tmp_path / "failed.json"), mode, str(project)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert failed.returncode == (75 if mode == "hang" else 1), failed.stderr[-4000:]
    promoted = project / "checkpoints" / "checkpoint_1"
    assert (
        f"accelkit launch: committed the memory snapshot of step 8 as {promoted} (newer than "
        "step 5 on disk)" in failed.stderr
    ), failed.stderr[-4000:]
    manifest = json.loads((promoted / "accelkit.json").read_text())
    assert (manifest["step"], manifest["world_size"], manifest["reason"]) == (8, 2, "memory")
    assert "process_index" not in manifest
    names = {entry["path"] for entry in manifest["files"]}
    assert {"random_states_0.json", "random_states_1.json", "model.safetensors"} <= names
    got, _ = _run(tmp_path, "requeued", "plain", restarts=0, project=project)
    assert got["loaded"] == str(promoted)
    assert got["digest"] == reference["digest"]


def test_a_failed_job_without_the_memory_tier_commits_nothing(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = subprocess.run(
        launch_args(script, str(tmp_path / "out.json"), "fail", str(tmp_path / "p"), processes=1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3
    assert "memory snapshot" not in proc.stderr
    assert not (tmp_path / "p" / "checkpoints").exists()


def _wait_gone(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_failed_job_leaves_no_shared_memory(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        launch_args(script, str(out), "fail", str(tmp_path / "p"), processes=1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-4000:]
    memory = json.loads(out.read_text())["memory"]
    assert os.path.basename(memory).startswith("accelkit-job-")
    assert not os.path.exists(memory)


def test_the_shared_memory_goes_when_the_launcher_is_sigkilled(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "out.json"
    launcher = subprocess.Popen(
        launch_args(script, str(out), "sleep", str(tmp_path / "p"), processes=1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or not out.read_text():
            assert time.monotonic() < deadline, "the job never started"
            assert launcher.poll() is None, "the launcher ended early"
            time.sleep(0.1)
        memory = json.loads(out.read_text())["memory"]
        while not (Path(memory) / "something").exists():  # the worker wrote there
            assert time.monotonic() < deadline, "the job never wrote to its memory"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        # The reaper saw the launcher's pipe close; the worker died with the launcher.
        assert _wait_gone(memory, 10), f"{memory} outlived the job"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_the_job_memory_folder_is_private(tmp_path: Path) -> None:
    from accelkit.launch.job_memory import JobMemory

    with JobMemory(root=str(tmp_path)) as path:
        assert os.stat(path).st_mode & 0o777 == 0o700
        (Path(path) / "x").write_text("y")
    assert not os.path.exists(path)
