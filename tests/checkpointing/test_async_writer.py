"""The writer process of asynchronous saves: same files as the thread, crashes, priority,
fall-backs and the ``async_writer`` setting.

Everything here runs the real writer process; a crash is a real ``kill -9`` of it. The shared
memory it reads is anonymous (``memfd``), so the leak checks look at processes and at
``/dev/shm`` both (tests/checkpointing/test_async.py has the exit, kill and Ctrl-C paths).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.commit import writer_process
from accelkit.checkpointing.errors import CheckpointError
from accelkit.errors import ConfigurationError
from tests.checkpointing.gatedfs import gated_url

pytestmark = [
    pytest.mark.usefixtures("open_gate"),
    pytest.mark.skipif(
        not writer_process.process_writer_available()[0],
        reason=writer_process.process_writer_available()[1] or "process writer available",
    ),
]


def _accelerator(project: str, width: int = 64, **config: Any) -> tuple[Accelerator, Any, Any]:
    torch.manual_seed(0)
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, **config
        ),
    )
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    return acc, model, optimizer


def _committed(root: Path) -> list[str]:
    folder = root / "checkpoints"
    return sorted(
        (p.name for p in folder.iterdir() if (p / "accelkit.json").exists()),
        key=lambda n: int(n.rsplit("_", 1)[1]),
    )


def _writer(acc: Accelerator) -> writer_process.WriterProcess:
    process = acc._checkpoints.background.process
    assert process is not None
    return process


def test_same_files_manifest_and_checksums_as_the_thread_writer(tmp_path: Path) -> None:
    manifests = {}
    for mode in ("thread", "process"):
        torch.manual_seed(1)
        acc, *_ = _accelerator(str(tmp_path / mode), async_writer=mode)
        torch.manual_seed(2)  # the same RNG state saved by both
        handle = acc.save_state(str(tmp_path / mode / "out"), async_save=True)
        handle.result(timeout=120)
        assert acc._checkpoints.background.last_writer == mode
        with open(tmp_path / mode / "out" / "accelkit.json") as f:
            manifests[mode] = json.load(f)
        acc.end_training()
    thread, process = manifests["thread"], manifests["process"]
    # The save marker (written by the training process for both) names its process and time.
    marker = ".accelkit-save.json"
    files = [e for e in thread["files"] if e["path"] != marker]
    assert files == [e for e in process["files"] if e["path"] != marker]  # sizes, checksums
    assert len(files) >= 4
    assert {k for k in thread if thread[k] != process[k]} <= {"created", "created_iso", "files"}
    for entry in files:
        a = (tmp_path / "thread" / "out" / entry["path"]).read_bytes()
        b = (tmp_path / "process" / "out" / entry["path"]).read_bytes()
        assert a == b, entry["path"]


def _kill_the_writer_mid_save(acc: Any, project: Path) -> tuple[int, Path, Any]:
    """Start the second save (checkpoint_1), SIGKILL the writer process once it has begun the
    files, wait until the save is over; the writer's pid, the save's folder and handle."""
    first = _writer(acc).pid
    assert first is not None
    handle = acc.save_state(async_save=True)
    folder = project / "checkpoints" / "checkpoint_1"
    deadline = time.monotonic() + 60
    while not (folder / "model.safetensors").exists():  # the writer has begun the files
        assert time.monotonic() < deadline and not handle.done()
        time.sleep(0.001)
    os.kill(first, signal.SIGKILL)
    while not handle.done():  # not exception(): the next save_state must report it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return first, folder, handle


@pytest.mark.slow
def test_a_killed_writer_fails_its_save_once_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 64 MB of weights: the write lasts long enough to be killed in the middle of it.
    acc, model, _ = _accelerator(str(tmp_path), width=2048, async_writer="process")
    acc.save_state(async_save=True).result(timeout=120)
    first, folder, handle = _kill_the_writer_mid_save(acc, tmp_path)
    # Not committed, and the automatic folder it had begun is gone.
    assert _committed(tmp_path) == ["checkpoint_0"] and not folder.exists()

    caplog.set_level(logging.WARNING, logger="accelkit")
    caplog.clear()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on
    second = acc.save_state(async_save=True)  # reports the crash (once), does not raise
    warnings = [r for r in caplog.records if "writer process died" in r.getMessage()]
    assert len(warnings) == 1 and "killed by SIGKILL" in warnings[0].getMessage()
    assert "checkpoint_1" in warnings[0].getMessage()
    assert second.result(timeout=120).endswith("checkpoint_2")
    assert _writer(acc).pid not in (None, first)  # a new writer
    saved = model[0].weight.detach().clone()
    acc.save_state(async_save=True).result(timeout=120)
    assert len([r for r in caplog.records if "writer process died" in r.getMessage()]) == 1
    assert _committed(tmp_path) == ["checkpoint_0", "checkpoint_2", "checkpoint_3"]
    # The handle of the lost save still says why, if asked.
    error = handle.exception()
    assert isinstance(error, CheckpointError) and "writer process died" in str(error)
    with torch.no_grad():
        model[0].weight.zero_()
    assert acc.load_state().endswith("checkpoint_3")
    assert torch.equal(model[0].weight, saved)
    saver = acc._checkpoints.background
    saver.close()  # the shared memory back; the writer (shared) stays for the next save
    assert saver._arena is None and _writer(acc).alive()


def _ioprio(pid: int) -> int | None:
    number = {"x86_64": 252, "aarch64": 31}.get(os.uname().machine)  # ioprio_get
    if number is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = int(libc.syscall(number, 1, pid))
    return None if value < 0 else value


def test_the_writer_runs_at_lower_cpu_and_io_priority(tmp_path: Path) -> None:
    acc, *_ = _accelerator(str(tmp_path), async_writer="process")
    acc.save_state(async_save=True).result(timeout=120)
    pid = _writer(acc).pid
    assert pid is not None
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + writer_process.NICENESS)
    value = _ioprio(pid)
    if value is not None and value != 0:  # 0: the kernel kept the default (none set)
        assert value >> 13 == 2 and value & 0xFF == 7  # best effort, lowest level
    acc.end_training()


def test_async_writer_setting_is_validated() -> None:
    with pytest.raises(ConfigurationError, match=r"async_writer must be one of .*'proc'"):
        ProjectConfiguration(async_writer="proc")
    for mode in ("auto", "process", "thread"):
        assert ProjectConfiguration(async_writer=mode).async_writer == mode


def test_remote_storage_falls_back_to_the_thread_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="accelkit")
    acc, *_ = _accelerator(gated_url(tmp_path), async_writer="process")
    acc.save_state(async_save=True).result(timeout=60)
    acc.save_state(async_save=True).result(timeout=60)
    saver = acc._checkpoints.background
    assert saver.last_writer == "thread" and saver.process is None
    notes = [r.getMessage() for r in caplog.records if "async_writer='process'" in r.getMessage()]
    assert len(notes) == 1 and "gatedfile:// storage is not the local disk" in notes[0]
    assert _committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]

    caplog.clear()
    auto, *_ = _accelerator(gated_url(tmp_path / "auto"), async_writer="auto")
    auto.save_state(async_save=True).result(timeout=60)  # silently
    assert auto._checkpoints.background.last_writer == "thread" and not caplog.records


def test_without_shared_memory_the_thread_writes_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared segments cannot be reserved (a full machine): ENOSPC from the reservation of
    a memfd segment, injected; every other file's reservation is real."""
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:accelkit"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full)
    caplog.set_level(logging.WARNING, logger="accelkit")
    acc, model, _ = _accelerator(str(tmp_path), async_writer="auto")
    path = acc.save_state(async_save=True).result(timeout=60)
    saver = acc._checkpoints.background
    assert saver.last_writer == "thread"
    notes = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(notes) == 1 and "No space left" in notes[0], notes
    acc.save_state(async_save=True).result(timeout=60)  # thread again, no new warning
    assert saver.last_writer == "thread" and saver._arena is None
    assert len([r for r in caplog.records if "shared memory" in r.getMessage()]) == 1
    assert _committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    weights = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.zero_()
    acc.load_state(path)
    assert torch.equal(model[0].weight, weights)
    acc.end_training()
