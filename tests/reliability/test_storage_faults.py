"""Storage faults: the S3 server dies mid-save and comes back; the local disk fills up.

Each time the save fails with a ``CheckpointError`` naming the checkpoint, nothing is
committed, the earlier checkpoints still verify, and the next save after the fault is gone
succeeds.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog.listing import list_checkpoints
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.storage import get_storage, join
from accelkit.cli.main import main as cli
from tests.fixtures.s3 import S3Server, _bucket_usable, _ready, start_s3_server

# Bounded retries for S3, passed through storage_options to botocore: 2 retries (3 attempts in
# all, botocore's "standard" mode), connections given up after 2 s, reads after 10 s.
BOUNDED = {
    "config_kwargs": {
        "retries": {"max_attempts": 2, "mode": "standard"},
        "connect_timeout": 2,
        "read_timeout": 10,
    }
}


class _Blob:
    """A registered object whose state is one tensor of a chosen size."""

    def __init__(self, nbytes: int) -> None:
        self.data = torch.zeros(nbytes, dtype=torch.uint8)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.data = state["data"]


def _accelerator(project: str, options: dict[str, Any], width: int) -> tuple[Accelerator, Any]:
    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=True,
        total_limit=2,
        storage_options=options,
        # accelkit's own retries off: this file proves what a save does when the storage
        # fails for good (tests/checkpointing/test_retry.py proves the retries)
        storage_retry_seconds=0,
    )
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator.prepare(model, optimizer)
    return accelerator, model


def _states(project: str, options: dict[str, Any]) -> dict[str, str]:
    root = join(project, "checkpoints")
    return {i.name: i.state for i in list_checkpoints(get_storage(root, options), root)}


def _verify(capsys: pytest.CaptureFixture[str], root: str, options: dict[str, Any]) -> str:
    import json

    flags = []
    for key, value in options.items():
        flags += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    capsys.readouterr()
    code = cli(["ckpt", "verify", root, *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


# ------------------------------------------------------------------ S3 server dies mid-save


@pytest.fixture
def own_s3_server() -> Iterator[S3Server]:
    """A SeaweedFS server of this test alone (it is killed and restarted)."""
    pytest.importorskip("s3fs")
    try:
        server = start_s3_server()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


def _kill(server: S3Server) -> list[str]:
    cmd = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    return cmd


def _restart(server: S3Server, cmd: list[str]) -> None:
    log = open(server.workdir / "server.log", "ab")  # noqa: SIM115 - handed to the process
    server.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=server.workdir)
    log.close()
    deadline = time.monotonic() + 60
    # Wait until a write and a read go through, not just until the gateway answers (right
    # after a restart the gateway can answer while its volume server is not back yet).
    while not (_ready(server.endpoint_url) and _bucket_usable(server)):
        assert server.process.poll() is None, (server.workdir / "server.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "SeaweedFS did not come back"
        time.sleep(0.2)


def test_s3_server_killed_mid_save_then_back(
    own_s3_server: S3Server,
    capsys: pytest.CaptureFixture[str],
    summary: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelkit.checkpointing.storage import _s3io

    server = own_s3_server
    options = {**server.storage_options, **copy.deepcopy(BOUNDED)}  # botocore edits it
    project = server.new_prefix()
    # ~12 MB of model + optimizer state in 1 MB shards: the kill lands between uploads.
    accelerator, model = _accelerator(project, options, width=512)
    accelerator.save_state(max_shard_size="1MB")
    accelerator.save_state(max_shard_size="1MB")
    before = _verify(capsys, join(project, "checkpoints"), options)

    cmd: list[str] = []
    armed = threading.Event()
    lock = threading.Lock()
    target = join(project, "checkpoints", "checkpoint_2")
    finish = _s3io.MultipartSink._finish

    def finish_then_kill(self: Any) -> None:
        # Kill the server as soon as the first object of the new checkpoint exists, i.e. in
        # the middle of its uploads, from the upload itself: a watcher polling the bucket
        # lost the race to a save of small files that completes in ~0.15 s.
        finish(self)
        if armed.is_set() and self._path.startswith(target.split("://", 1)[1] + "/"):
            with lock:
                if not cmd:
                    cmd.extend(_kill(server))

    def kill_once_uploading(models: Any, weights: Any, output_dir: str) -> None:
        armed.set()

    monkeypatch.setattr(_s3io.MultipartSink, "_finish", finish_then_kill)
    handle = accelerator.register_save_state_pre_hook(kill_once_uploading)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        accelerator.save_state(max_shard_size="1MB")
    failed_after = time.monotonic() - start
    handle.remove()
    message = str(info.value)
    assert "checkpoint_2" in message and "not committed" in message, message
    assert cmd, "the server was not killed"

    # While it is down, a save fails the same way, whatever stage it reaches.
    start = time.monotonic()
    with pytest.raises(Exception) as down:
        accelerator.save_state(max_shard_size="1MB")
    down_after = time.monotonic() - start
    assert "checkpoint_3" in str(down.value), down.value

    _restart(server, cmd)
    states = _states(project, options)
    assert states.get("checkpoint_0") == states.get("checkpoint_1") == "committed", states
    assert states.get("checkpoint_2", "incomplete") == "incomplete", states
    after = _verify(capsys, join(project, "checkpoints"), options)
    assert "OK    checkpoint_0" in after and "OK    checkpoint_1" in after
    assert before.count("OK") == 2

    path = accelerator.save_state(max_shard_size="1MB")  # the server is back: this works
    states = _states(project, options)
    committed = sorted(name for name, state in states.items() if state == "committed")
    assert committed == ["checkpoint_1", path.rstrip("/").rsplit("/", 1)[-1]], states
    fresh, fresh_model = _accelerator(project, options, width=512)
    assert fresh.load_state() == path
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)

    summary["s3_server_killed_mid_save"] = {
        "trials": 1,
        "held": 1,
        "failed_save_seconds_bounded": round(failed_after, 2),
        "save_while_down_seconds_bounded": round(down_after, 2),
        "save_while_down_error": f"{type(down.value).__name__}: {str(down.value)[:160]}",
        "storage_options": BOUNDED,
    }


# ------------------------------------------------------------------ full disk


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 4 MB tmpfs (needs root and mount permission; skipped with the reason otherwise)."""
    folder = Path(tempfile.mkdtemp(prefix="accelkit-full-"))
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"cannot mount a 4 MB tmpfs here: {result.stderr.strip() or result}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        with contextlib.suppress(OSError):
            folder.rmdir()


def test_full_disk_fails_naming_the_path_and_commits_nothing(
    small_disk: Path, capsys: pytest.CaptureFixture[str], summary: dict[str, Any]
) -> None:
    project = str(small_disk / "project")
    accelerator, _ = _accelerator(project, {}, width=64)  # ~100 KB a checkpoint
    blob = _Blob(1000)
    accelerator.register_for_checkpointing(blob)
    accelerator.save_state()
    _verify(capsys, join(project, "checkpoints"), {})

    # 1. The data does not fit: a 5 MB object on a 4 MB disk.
    blob.data = torch.ones(5 * 2**20, dtype=torch.uint8)
    with pytest.raises(CheckpointError) as info:
        accelerator.save_state()
    message = str(info.value)
    assert "checkpoint_1" in message and "No space left" in message, message
    assert "not committed" in message, message
    # It says what a full disk means for a save (total_limit=2 here), and the fix.
    assert "room for total_limit + 1 = 3 checkpoints" in message, message
    assert "lower total_limit" in message, message
    states = _states(project, {})
    assert states.get("checkpoint_0") == "committed", states
    assert "checkpoint_1" not in states or states["checkpoint_1"] == "incomplete", states

    # 2. The data fits but the manifest does not: fill the disk up to what the data needs.
    blob.data = torch.ones(1000, dtype=torch.uint8)
    sizes = get_storage(project).walk_files(join(project, "checkpoints", "checkpoint_0"))
    need = sum(-(-size // 4096) * 4096 for name, size in sizes.items() if name != "accelkit.json")
    filler = small_disk / "filler"
    stat = os.statvfs(small_disk)
    filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - need))
    with pytest.raises(CheckpointError) as info2:
        accelerator.save_state()
    second = str(info2.value)
    assert "checkpoint_2" in second and "No space left" in second, second
    assert "total_limit + 1 = 3" in second, second
    manifest_failed = "Committing" in second
    states = _states(project, {})
    assert "corrupt" not in states.values(), states
    assert states.get("checkpoint_0") == "committed", states

    # 3. Space is back: the next save works and everything verifies.
    filler.unlink()
    path = accelerator.save_state()
    assert _states(project, {})[path.rsplit("/", 1)[-1]] == "committed"
    _verify(capsys, join(project, "checkpoints"), {})
    summary["full_disk_tmpfs_4MB"] = {
        "trials": 2,
        "held": 2,
        "data_did_not_fit_error": message[:200],
        "manifest_did_not_fit_error": second[:200],
        "manifest_write_hit_enospc": manifest_failed,
    }
