"""Asynchronous saves: snapshot at the call, background write and commit, failures, exit.

Slow writes come from ``gatedfile://`` (tests/checkpointing/gatedfs.py): the real local disk
behind an fsspec filesystem whose writes wait for a gate, so "the write has not finished yet" is
a state the test controls, not a race.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.commit.async_save import AsyncCheckpoint
from accelkit.checkpointing.commit.snapshot import HostSnapshot
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.objects.contents import Snapshot
from tests.checkpointing.writer_gate import WRITERS, WriterGate
from tests.helpers.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("open_gate")


@pytest.fixture(params=WRITERS)
def gate(request: pytest.FixtureRequest) -> Any:
    """Each test runs with both writers: the thread and the writer process."""
    held = WriterGate(request.param)
    yield held
    held.reset()


def _local(path: str) -> str:
    return path.split("://", 1)[1] if "://" in path else path


class Tied(nn.Module):
    """Embedding and output layer sharing one weight (stored once in the model file)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


class History:
    """A registered object whose state_dict hands out its live list (no copy)."""

    def __init__(self) -> None:
        self.values: list[int] = [1, 2]
        self.scale = torch.ones(3)

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values, "scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = list(state["values"])
        self.scale = state["scale"].clone()


def _setup(project: str, **config: Any) -> tuple[Accelerator, nn.Module, Any, Any, History]:
    torch.manual_seed(0)
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, **config
        ),
    )
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    history = History()
    acc.register_for_checkpointing(history)
    _train_step(acc, model, optimizer, scheduler)
    return acc, model, optimizer, scheduler, history


def _train_step(acc: Accelerator, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    loss = model(torch.tensor([[0, 1, 2, 3]])).square().mean()
    acc.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _clone_state(model: nn.Module, optimizer: Any, scheduler: Any, history: History) -> Any:
    opt = optimizer.state_dict()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
        scheduler.state_dict()["last_epoch"],
        (list(history.values), history.scale.clone()),
    )


def _assert_state(got: Any, want: Any) -> None:
    for k in want[0]:
        assert torch.equal(got[0][k], want[0][k]), k
    for i in want[1]:
        for k in want[1][i]:
            assert torch.equal(got[1][i][k], want[1][i][k]), (i, k)
    assert got[2] == want[2]
    assert got[3][0] == want[3][0] and torch.equal(got[3][1], want[3][1])


@pytest.mark.slow
def test_changes_after_the_call_do_not_reach_the_checkpoint(
    tmp_path: Path, gate: WriterGate
) -> None:
    acc, model, optimizer, scheduler, history = _setup(gate.url(tmp_path), **gate.config())
    at_call = _clone_state(model, optimizer, scheduler, history)

    gate.hold(acc)
    handle = acc.save_state(async_save=True)
    assert isinstance(handle, AsyncCheckpoint)
    random_after_call = torch.rand(3)  # the saved RNG state is the one at the call
    assert gate.waiting() and not handle.done()
    # Change everything in place while the files are being written.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    _train_step(acc, model, optimizer, scheduler)
    history.values.append(99)
    history.scale.mul_(7)
    assert _clone_state(model, optimizer, scheduler, history)[2] != at_call[2]
    gate.release()

    path = handle.result(timeout=60)
    assert handle.done() and handle.exception() is None
    assert acc._checkpoints.background.last_writer == gate.mode
    local = _local(path)
    assert local.endswith("checkpoint_0") and os.path.exists(os.path.join(local, "accelkit.json"))
    assert acc.save_iteration == 1
    # Tied weights stay tied in the host copy: stored once, as a synchronous save does.
    from safetensors import safe_open

    with safe_open(os.path.join(local, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert len(stored) == len(model.state_dict()) - 1

    torch.rand(5)
    acc.load_state(local)
    _assert_state(_clone_state(model, optimizer, scheduler, history), at_call)
    assert torch.equal(torch.rand(3), random_after_call)


def test_host_buffers_are_reused_and_hold_one_copy() -> None:
    weights = {"w": torch.randn(64, 8), "b": torch.randn(8), "t": torch.randn(8, 3).t()}
    tied = {**weights, "w_tied": weights["w"]}
    state = {"exp_avg": torch.randn(64, 8), "step": 3, "names": ["a"]}
    host = HostSnapshot()
    first = host.capture(Snapshot(models=[("model", tied)], states=[("optimizer", state)]))
    buffers = {k: v.data_ptr() for k, v in host.buffers().items()}
    expected = sum(t.numel() * t.element_size() for t in [*weights.values(), state["exp_avg"]])
    assert host.nbytes == expected == first.nbytes  # one copy; the tied weight counted once
    assert first.models[0][1]["w_tied"] is first.models[0][1]["w"]
    for name, tensor in weights.items():  # contiguous (memmove) and strided (copy_) sources
        assert torch.equal(first.models[0][1][name], tensor), name

    weights["w"].add_(1.0)
    state["names"].append("b")
    assert not torch.equal(first.models[0][1]["w"], weights["w"])
    assert first.states[0].tree["names"] == ["a"]
    second = host.capture(Snapshot(models=[("model", tied)], states=[("optimizer", state)]))
    assert {k: v.data_ptr() for k, v in host.buffers().items()} == buffers  # reused
    assert torch.equal(second.models[0][1]["w"], weights["w"])

    # A tensor that changes size gets a new buffer; one no longer saved is released.
    smaller = host.capture(Snapshot(models=[("model", {"w": torch.randn(4)})]))
    assert host.nbytes == smaller.nbytes == 16


def _committed(root: Path) -> list[str]:
    folder = root / "checkpoints"
    return sorted(
        (p.name for p in folder.iterdir() if (p / "accelkit.json").exists()),
        key=lambda n: int(n.rsplit("_", 1)[1]),
    )


def test_background_failure_is_logged_raised_and_not_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, gate: WriterGate
) -> None:
    acc, model, *_ = _setup(gate.url(tmp_path), **gate.config())
    first = acc.save_state(async_save=True).result(timeout=60)
    weights = model.state_dict()["mid.weight"].clone()

    gate.fail(acc, "optimizer.safetensors")
    caplog.set_level(logging.ERROR, logger="accelkit")
    gate.hold(acc)
    handle = acc.save_state(async_save=True)
    assert gate.waiting() and not caplog.records
    gate.release()
    with pytest.raises(CheckpointError, match=gate.failure_text):
        acc.wait_for_checkpoints()
    # Logged by the writer when it happened (before anyone waited), raised once.
    assert [r.name for r in caplog.records] == ["accelkit.checkpointing.commit.async_save"]
    assert gate.failure_text in caplog.records[0].getMessage()
    acc.wait_for_checkpoints()
    assert isinstance(handle.exception(), CheckpointError)
    assert _committed(tmp_path) == ["checkpoint_0"]
    assert not (tmp_path / "checkpoints" / "checkpoint_1").exists()  # removed, never committed

    acc.save_state(async_save=True)  # fails in the background too ...
    with pytest.raises(CheckpointError, match="checkpoint_2"):
        acc.save_state(async_save=True)  # ... and the next save_state raises it, saving nothing
    acc.save_state(async_save=True)
    with pytest.raises(CheckpointError, match="checkpoint_3"):
        acc.load_state()  # so does load_state
    acc.save_state(async_save=True)
    with pytest.raises(CheckpointError, match="checkpoint_4"):
        acc.end_training()  # and end_training
    seen = acc.save_state(async_save=True)
    with pytest.raises(CheckpointError, match="checkpoint_5"):
        seen.result()  # a failure the caller got from the handle is not raised again:
    gate.fail(acc, None)
    acc.wait_for_checkpoints()
    assert _committed(tmp_path) == ["checkpoint_0"]
    with torch.no_grad():
        model.mid.weight.zero_()
    assert acc.load_state() == first  # the earlier checkpoint, intact
    assert torch.equal(model.state_dict()["mid.weight"], weights)
    assert acc.save_state(async_save=True).result(timeout=60).endswith("checkpoint_1")


def test_retention_runs_only_after_the_commit(tmp_path: Path, gate: WriterGate) -> None:
    acc, *_ = _setup(gate.url(tmp_path), total_limit=2, **gate.config())
    acc.save_state(async_save=True)
    acc.save_state(async_save=True)
    acc.wait_for_checkpoints()
    assert _committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]

    gate.hold(acc)
    handle = acc.save_state(async_save=True)
    assert gate.waiting()
    # In flight: the old ones are all still there, the new one is not committed yet.
    assert _committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    assert (tmp_path / "checkpoints" / "checkpoint_2").is_dir()
    assert (tmp_path / ".accelkit-run.lock").exists()  # the project's save lock is held
    gate.release()
    handle.result(timeout=60)
    assert _committed(tmp_path) == ["checkpoint_1", "checkpoint_2"]
    assert not (tmp_path / ".accelkit-run.lock").exists()  # and given back after the commit
    acc.save_state(async_save=True)
    acc.wait_for_checkpoints()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]


def test_configuration_default_and_sync_calls(tmp_path: Path, gate: WriterGate) -> None:
    acc, *_ = _setup(str(tmp_path), async_save=True, **gate.config())
    handle = acc.save_state()
    assert isinstance(handle, AsyncCheckpoint)
    path = acc.save_state(async_save=False)  # waits for the one in flight first
    assert handle.done() and isinstance(path, str) and path.endswith("checkpoint_1")
    assert _committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    # An explicit folder is reused: the first save into it is un-committed, then rewritten.
    explicit = str(tmp_path / "explicit")
    acc.save_state(explicit, async_save=True)
    assert acc.save_state(explicit, async_save=True).result(timeout=60) == explicit
    assert (tmp_path / "explicit" / "accelkit.json").exists()


# ---------------------------------------------------------------------- two processes


def _two_process_job(local: str, mode: str) -> dict[str, Any]:
    import torch.distributed as dist

    gate = WriterGate(mode)
    acc, model, optimizer, scheduler, history = _setup(
        gate.url(local), total_limit=2, **gate.config()
    )
    rank = acc.process_index
    out: dict[str, Any] = {"rank": rank}
    at_call = _clone_state(model, optimizer, scheduler, history)

    gate.hold(acc)
    handle = acc.save_state(async_save=True)
    random_after_call = torch.rand(2)
    out["waiting"] = gate.waiting() and not handle.done()
    # Training collectives on the default group while the writer is between its own.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["all_reduce"] = float(total)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(10.0)
    history.values.append(rank)
    gate.release()
    out["path"] = _local(handle.result(timeout=120))
    out["writer"] = acc._checkpoints.background.last_writer
    with open(os.path.join(out["path"], "accelkit.json")) as f:
        out["manifest"] = json.load(f)
    acc.load_state(out["path"])
    out["restored"] = True
    _assert_state(_clone_state(model, optimizer, scheduler, history), at_call)
    out["rng_restored"] = bool(torch.equal(torch.rand(2), random_after_call))

    for _ in range(3):  # retention with async saves, on the main process after each commit
        acc.save_state(async_save=True)
    acc.wait_for_checkpoints()
    out["kept"] = sorted(os.listdir(os.path.join(local, "checkpoints")))
    acc.wait_for_everyone()  # both have listed before the next save creates its folder

    gate.fail(acc, "random_states_1" if rank == 1 else None)
    failed = acc.save_state(async_save=True)
    try:
        acc.wait_for_checkpoints()
        out["failure"] = None
    except CheckpointError as exc:
        out["failure"] = str(exc)
    out["failed_path"] = _local(failed.path)
    gate.fail(acc, None)
    acc.end_training()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", WRITERS)
def test_two_processes_commit_every_rank_file_then_load(tmp_path: Path, mode: str) -> None:
    local = str(tmp_path)
    r0, r1 = run_distributed(_two_process_job, local, mode, world_size=2)
    for r in (r0, r1):
        assert r["waiting"] and r["all_reduce"] == 3.0 and r["writer"] == mode
        assert r["path"] == os.path.join(local, "checkpoints", "checkpoint_0")
        assert r["restored"] and r["rng_restored"]
    manifest = r0["manifest"]
    files = {f["path"] for f in manifest["files"]}
    assert {"random_states_0.json", "random_states_1.json", "model.safetensors"} <= files
    assert manifest["world_size"] == 2
    assert r0["kept"] == r1["kept"] == ["checkpoint_2", "checkpoint_3"]
    # A failure on process 1 reaches both processes; nothing is committed.
    assert r0["failure"] is not None and "process 1" in r0["failure"]
    assert r1["failure"] is not None and WriterGate(mode).failure_text in r1["failure"]
    assert not os.path.exists(os.path.join(r0["failed_path"], "accelkit.json"))


# ---------------------------------------------------------------------- interpreter exit

_EXIT_SCRIPT = """
import os, signal, sys, threading, time, torch
from torch import nn
from accelkit import Accelerator, ProjectConfiguration
from tests.checkpointing.writer_gate import WriterGate

# As in a terminal: Ctrl-C raises KeyboardInterrupt. (A test run started in the background by a
# non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored.)
signal.signal(signal.SIGINT, signal.default_int_handler)

folder, mode, writer = sys.argv[1], sys.argv[2], sys.argv[3]
gate = WriterGate(writer)
if mode == "local":
    # A real local disk: its files are fsync-ed by a thread pool that interpreter exit shuts
    # down; the save (128 MB, seconds here) is still being written when the script ends.
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=folder, automatic_checkpoint_naming=True, async_writer=writer))
    acc.prepare(nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096)))
    acc.save_state(async_save=True)
    sys.exit(0)
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=gate.url(folder), automatic_checkpoint_naming=True, async_writer=writer))
model = acc.prepare(nn.Linear(64, 64))
acc.save_state()  # checkpoint_0, synchronous
gate.attach(acc)
gate.hold(acc)
handle = acc.save_state(async_save=True)  # checkpoint_1, held
assert gate.waiting()
process = acc._checkpoints.background.process
print("in flight", handle.done(), process.pid if process else 0, flush=True)
if mode == "exit":
    # Lets the save go on from another thread after the main thread has finished.
    threading.Timer(0.5, gate.release).start()
else:
    while True:  # the test kills or interrupts the process here
        time.sleep(0.05)
"""


def _start(tmp_path: Path, mode: str, writer: str) -> subprocess.Popen[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / mode), mode, writer],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: "Ctrl-C" reaches it and its writer
    )


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (or is a zombie nobody reaped) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _ours(entries: set[str], pids: list[int]) -> list[str]:
    """Entries of /dev/shm that accelkit or one of ``pids`` could have made (other programs
    share this machine's /dev/shm). The job memory of an ``accelkit launch`` (``accelkit-job-*``)
    is not: these tests launch nothing, and a launch of another test running beside them makes
    one (``tests/cli/test_launch_memory_tier.py`` checks that it goes)."""
    return sorted(
        e
        for e in entries
        if not e.startswith("accelkit-job-") and ("accelkit" in e or any(str(p) in e for p in pids))
    )


@pytest.mark.slow
@pytest.mark.parametrize("writer", WRITERS)
def test_interpreter_exit_completes_the_save_and_a_kill_leaves_it_incomplete(
    tmp_path: Path, writer: str
) -> None:
    shm_before = _shm()
    exiting, local = _start(tmp_path, "exit", writer), _start(tmp_path, "local", writer)
    outputs = []
    for proc in (exiting, local):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "failed" not in err, err
        outputs.append(out)
    line = outputs[0].split()
    assert line[:3] == ["in", "flight", "False"]  # the main thread ended before it
    pids = [exiting.pid, local.pid, int(line[3])]
    assert _committed(tmp_path / "exit") == ["checkpoint_0", "checkpoint_1"]
    assert _committed(tmp_path / "local") == ["checkpoint_0"]

    proc = _start(tmp_path, "kill", writer)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:3] == ["in", "flight", "False"]
    writer_pid = int(line[3])
    proc.kill()
    if writer == "process":  # held by SIGSTOP: let it see that its parent is gone
        os.kill(writer_pid, signal.SIGCONT)
        assert _gone(writer_pid), "the writer process outlived the killed training process"
        pids.append(writer_pid)
    proc.communicate(timeout=60)
    run = tmp_path / "kill"
    assert (run / "checkpoints" / "checkpoint_1").is_dir()
    assert _committed(run) == ["checkpoint_0"]  # the killed save never counts

    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(run), automatic_checkpoint_naming=True),
    )
    acc.prepare(nn.Linear(64, 64))
    assert acc.load_state().endswith("checkpoint_0")
    assert acc.save_iteration == 2  # past the incomplete folder too
    assert _ours(_shm() - shm_before, pids) == []


@pytest.mark.slow
def test_ctrl_c_finishes_the_save_and_leaves_no_writer(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group: the writer ignores it, training exits through
    KeyboardInterrupt, interpreter exit waits for the save, then the writer exits."""
    shm_before = _shm()
    proc = _start(tmp_path, "interrupt", "process")
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    writer_pid = int(line[3])
    fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C
    time.sleep(0.5)
    assert not _gone(writer_pid, timeout=0.1)  # ignored by the writer (held by SIGSTOP here)
    os.kill(writer_pid, signal.SIGCONT)
    _out, err = proc.communicate(timeout=120)
    assert "KeyboardInterrupt" in err, err
    assert _committed(tmp_path / "interrupt") == ["checkpoint_0", "checkpoint_1"], err
    assert _committed(tmp_path / "interrupt") == ["checkpoint_0", "checkpoint_1"]
    assert _gone(writer_pid), "the writer process outlived the training process"
    # The snapshot was anonymous shared memory: nothing named under /dev/shm, ever.
    assert any(link.startswith("/memfd:accelkit-snapshot") for link in fds), fds
    assert _ours(_shm() - shm_before, [proc.pid, writer_pid]) == []


# ---------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_uses_reused_pinned_buffers(tmp_path: Path, gate: WriterGate) -> None:
    acc = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=gate.url(tmp_path), automatic_checkpoint_naming=True, **gate.config()
        )
    )
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    assert next(model.parameters()).is_cuda

    def step() -> None:
        loss = model(torch.randn(32, 256, device=acc.device)).square().mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    step()
    at_call = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    gate.attach(acc)
    gate.hold(acc)
    handle = acc.save_state(async_save=True)
    for _ in range(3):  # queued on the GPU right after the call
        step()
    snapshot = acc._checkpoints.background.snapshot
    buffers = snapshot.buffers()
    assert buffers and all(b.is_pinned() for k, b in buffers.items() if k[0] == "model")
    pointers = {k: b.data_ptr() for k, b in buffers.items()}
    gate.release()
    path = _local(handle.result(timeout=120))
    assert acc._checkpoints.background.last_writer == gate.mode
    acc.save_state(async_save=True).result(timeout=120)
    assert {k: b.data_ptr() for k, b in snapshot.buffers().items()} == pointers

    acc.load_state(path)
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), at_call[k]), k
