"""Deleting checkpoints (retention and ``ckpt prune``): un-commit, then remove, under the lock.

The prune-against-a-live-save test runs a real second process whose asynchronous save is held
in flight (``gatedfile://``), so its save lock is genuinely held by a live run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from accelkit.checkpointing.catalog.listing import INCOMPLETE, list_checkpoints
from accelkit.checkpointing.commit.deletion import delete_checkpoint, project_of
from accelkit.checkpointing.commit.lock import LOCK_NAME, PRUNE, RunLock, _start_time
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.storage import Storage, get_storage
from accelkit.cli.main import main
from tests.cli.ckpt_fixtures import build_run

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("open_gate")


def _states(root: str) -> dict[str, str]:
    return {i.name: i.state for i in list_checkpoints(get_storage(root), root)}


class RemoveFailsOn:
    """The real storage, except that removing a path containing ``fail_on`` raises: a delete
    interrupted half-way (a crash, a permission problem)."""

    def __init__(self, inner: Storage, fail_on: str) -> None:
        self.inner = inner
        self.fail_on = fail_on

    def remove(self, url: str) -> None:
        if self.fail_on in url:
            raise PermissionError(f"injected: cannot remove {url}")
        self.inner.remove(url)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_delete_uncommits_refuses_what_it_cannot_prove_and_skips_late_commits(
    tmp_path: Path,
) -> None:
    build_run(str(tmp_path))
    root = str(tmp_path / "checkpoints")
    storage = get_storage(root)
    infos = {i.name: i for i in list_checkpoints(storage, root)}
    assert delete_checkpoint(storage, root, infos["checkpoint_0"])
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists()

    # Planned as incomplete, committed meanwhile: skipped, kept.
    (tmp_path / "checkpoints" / "checkpoint_2" / "accelkit.json").write_text("{}")
    assert not delete_checkpoint(storage, root, infos["checkpoint_2"])
    assert (tmp_path / "checkpoints" / "checkpoint_2").is_dir()

    foreign = tmp_path / "checkpoints" / "checkpoint_9"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"somebody else's")
    info = {i.name: i for i in list_checkpoints(storage, root)}["checkpoint_9"]
    with pytest.raises(CheckpointError, match="foreign"):
        delete_checkpoint(storage, root, info)
    elsewhere = str(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="not directly inside"):
        delete_checkpoint(storage, elsewhere, infos["checkpoint_1"])
    assert foreign.is_dir() and (tmp_path / "checkpoints" / "checkpoint_1").is_dir()


def test_an_interrupted_delete_leaves_an_incomplete_folder_the_next_prune_removes(
    tmp_path: Path,
) -> None:
    build_run(str(tmp_path))
    root = str(tmp_path / "checkpoints")
    info = {i.name: i for i in list_checkpoints(get_storage(root), root)}["checkpoint_1"]
    broken = cast(Storage, RemoveFailsOn(get_storage(root), "optimizer"))
    with pytest.raises(PermissionError):
        delete_checkpoint(broken, root, info)
    # Un-committed, its save marker still there: provably accelkit's, never "foreign".
    assert _states(root)["checkpoint_1"] == INCOMPLETE
    assert main(["ckpt", "prune", str(tmp_path), "--keep", "2", "--yes"]) == 0
    assert "checkpoint_1" not in _states(root)


def test_project_of_a_checkpoints_folder() -> None:
    assert project_of("/runs/a/checkpoints") == "/runs/a"
    assert project_of("s3://bucket/run/checkpoints/") == "s3://bucket/run"
    assert project_of("memory://checkpoints") == "memory://checkpoints"
    assert project_of("/runs/a/other") == "/runs/a/other"


_SAVER = """
import sys
from torch import nn
from accelkit import Accelerator, ProjectConfiguration
from tests.checkpointing.gatedfs import GatedFileSystem, gated_url

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=gated_url(sys.argv[1]), automatic_checkpoint_naming=True))
acc.prepare(nn.Linear(8, 8))
acc.save_state()
acc.save_state()
GatedFileSystem.gate.clear()
handle = acc.save_state(async_save=True)
assert GatedFileSystem.writes_waiting.wait(60)
print("in flight", flush=True)
sys.stdin.readline()
GatedFileSystem.gate.set()
print(handle.result(timeout=120), flush=True)
"""


@pytest.mark.slow
def test_prune_is_refused_while_a_live_run_saves_then_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "saver.py"
    script.write_text(textwrap.dedent(_SAVER))
    project = tmp_path / "project"
    saver = subprocess.Popen(
        [sys.executable, str(script), str(project)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert saver.stdout is not None and saver.stdin is not None
        assert saver.stdout.readline().strip() == "in flight", saver.stderr
        before = sorted(os.listdir(project / "checkpoints"))
        capsys.readouterr()
        code = main(["ckpt", "prune", str(project), "--keep", "1", "--yes"])
        err = capsys.readouterr().err
        assert code == 1, err
        assert f"pid {saver.pid}" in err and "save in flight" in err
        assert "Nothing was deleted" in err and LOCK_NAME in err
        assert sorted(os.listdir(project / "checkpoints")) == before
        holder = json.loads((project / LOCK_NAME).read_text())
        assert holder["pid"] == saver.pid  # the save's lock is untouched

        out, err = saver.communicate("\n", timeout=120)
        assert saver.returncode == 0, err
        assert out.strip().endswith("checkpoint_2")
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    assert main(["ckpt", "prune", str(project), "--keep", "1", "--yes"]) == 0
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_2"]
    assert not (project / LOCK_NAME).exists()  # the prune gave its lock back


def test_a_save_waits_for_a_live_prune(tmp_path: Path) -> None:
    project = str(tmp_path / "project")
    lock_file = tmp_path / "project" / LOCK_NAME
    lock_file.parent.mkdir()
    pruner = subprocess.Popen(["sleep", "60"])
    try:
        started = _start_time(pruner.pid)
        holder = {"host": RunLock(get_storage(project), project).host, "pid": pruner.pid}
        lock_file.write_text(
            json.dumps({**holder, "started": started, "role": PRUNE, "updated": time.time()})
        )
        save_lock = RunLock(get_storage(project), project)
        taken = threading.Event()
        errors: list[BaseException] = []

        def take() -> None:
            try:
                save_lock.acquire()
                taken.set()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=take)
        thread.start()
        assert not taken.wait(0.5) and not errors  # waiting, not refused
        lock_file.unlink()  # the prune finished
        thread.join(30)
        assert taken.is_set() and not errors
        assert json.loads(lock_file.read_text())["role"] == "save"
        save_lock.release()
        # A second prune meeting a live prune is refused at once, naming it.
        lock_file.write_text(
            json.dumps({**holder, "started": started, "role": PRUNE, "updated": time.time()})
        )
        with pytest.raises(CheckpointError, match="is being pruned"):
            RunLock(get_storage(project), project, role=PRUNE).acquire()
    finally:
        pruner.kill()
        pruner.wait()
