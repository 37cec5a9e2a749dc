"""The commit sequence when the processes of one save pass different folders.

In-process "processes" (:mod:`tests.checkpointing.fake_coordinator`), real files on the local
disk and the real writers; the 2-process resume through ``Accelerator`` is in
``tests/distributed/test_per_process_checkpoints.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit.checkpointing.commit.lock import LOCK_NAME, RunLock
from accelkit.checkpointing.commit.payload import LivePayload
from accelkit.checkpointing.commit.per_process import folder_key
from accelkit.checkpointing.commit.protocol import PHASES, SaveRequest, SaveSequence
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError
from accelkit.checkpointing.objects.contents import Snapshot
from accelkit.checkpointing.restore.loading import check_owner
from accelkit.checkpointing.storage import get_storage
from tests.checkpointing.fake_coordinator import FakeCoordinator, FakeGroup, run_ranks


def _save(
    folders: list[str],
    automatic: bool = False,
    sharded: bool = False,
    project: str | None = None,
) -> tuple[FakeGroup, list[Any]]:
    """Every "process" saves its own random states, and the replicated model where it writes
    it: into its own folder in a per-process save, on the main process only in a shared one
    (what the manager captures)."""
    hub = FakeGroup(len(folders))

    def body(rank: int, coordinator: FakeCoordinator) -> bool:
        lock = RunLock(get_storage(project), project) if project and rank == 0 else None
        request = SaveRequest(folders[rank], automatic, iteration=3, step=7, sharded=sharded)
        sequence = SaveSequence(coordinator, get_storage(folders[rank]), request, lock=lock)
        sequence.prepare()
        writes_model = sequence.per_process or rank == 0  # known once the folders are agreed
        models = [("model", {"w": torch.arange(4.0)})] if writes_model else []
        states = [(f"random_states_{rank}", {"seed": rank})]
        sequence.capture(lambda: LivePayload(Snapshot(models=models, states=states)))
        sequence.finish()
        return sequence.per_process

    return hub, run_ranks(hub, body)


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "accelkit.json").read_text())


def test_each_process_commits_its_own_folder(tmp_path: Path) -> None:
    folders = [tmp_path / "a", tmp_path / "b"]
    stale = folders[1] / "random_states_5.json"  # from an earlier save into this folder
    stale.parent.mkdir()
    stale.write_text("{}")
    hub, results = _save([str(f) for f in folders])
    assert results == [True, True]
    assert hub.phases == [list(PHASES), list(PHASES)]  # no exchange more than a shared save
    for rank, folder in enumerate(folders):
        manifest = _manifest(folder)
        assert manifest["process_index"] == rank and manifest["world_size"] == 2
        assert manifest["iteration"] == 3 and manifest["step"] == 7
        files = {f["path"] for f in manifest["files"]}
        # Prepared like the main process's folder (the save marker first), then its own files.
        assert files == {".accelkit-save.json", "model.safetensors", f"random_states_{rank}.json"}
    assert not stale.exists()


def test_a_shared_folder_stays_one_checkpoint_without_process_index(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    # Spelled differently on each process: still one folder.
    _, results = _save([str(folder), str(folder) + "/", os.path.relpath(folder)])
    assert results == [False, False, False]
    manifest = _manifest(folder)
    assert "process_index" not in manifest and manifest["world_size"] == 3
    files = {f["path"] for f in manifest["files"]}
    assert {f"random_states_{r}.json" for r in range(3)} <= files


def test_some_processes_sharing_a_folder_is_refused(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    hub, results = _save([a, a, b])
    for result in results:  # the same error on every process, before any capture
        assert isinstance(result, CheckpointError), result
        assert f"{a}: processes 0, 1" in str(result) and f"process 2: {b}" in str(result)
        assert "same output_dir on every process" in str(result)
    assert hub.phases == [["prepare"]] * 3
    assert not Path(b).exists() and not (Path(a) / "accelkit.json").exists()


def test_sharded_state_into_different_folders_is_refused(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _, results = _save([a, b], sharded=True)
    for result in results:
        assert isinstance(result, CheckpointError), result
        assert "sharded (FSDP) state" in str(result)
        assert f"process 0: {a}, process 1: {b}" in str(result)
    assert not Path(b).exists()


def test_automatic_names_that_differ_are_refused(tmp_path: Path) -> None:
    project = str(tmp_path / "project")
    folders = [f"{project}/checkpoints/checkpoint_3", str(tmp_path / "other" / "checkpoint_3")]
    _, results = _save(folders, automatic=True, project=project)
    for result in results:
        assert isinstance(result, CheckpointError), result
        assert "project_dir must name the same folder on every process" in str(result)
    assert not Path(folders[0]).exists()  # the main process's spent folder is removed
    assert not (Path(project) / LOCK_NAME).exists()  # and the lock given back


def test_a_process_that_cannot_prepare_its_folder_fails_every_process(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    b.write_text("a file where process 1's folder should be")
    _, results = _save([str(a), str(b)])
    for result in results:
        assert isinstance(result, CheckpointError), result
        assert "failed on process 1" in str(result) and "not committed" in str(result)
    assert not (a / "accelkit.json").exists()


def test_process_index_in_the_manifest() -> None:
    manifest = Manifest(iteration=None, step=0, world_size=2, files=[], process_index=1)
    assert Manifest.from_json(manifest.to_json()).process_index == 1
    shared = Manifest(iteration=None, step=0, world_size=2, files=[])
    assert "process_index" not in shared.to_json()
    assert Manifest.from_json(shared.to_json()).process_index is None
    bad = json.loads(manifest.to_json())
    bad["process_index"] = 2
    with pytest.raises(ManifestError, match="'process_index' must be a process of the 2"):
        Manifest.from_json(json.dumps(bad), source="x/accelkit.json")


def test_a_per_process_checkpoint_belongs_to_its_writer() -> None:
    manifest = Manifest(iteration=None, step=0, world_size=4, files=[], process_index=2)
    check_owner(manifest, "ckpt", 2)
    with pytest.raises(CheckpointError, match="process 2 saved into a folder of its own"):
        check_owner(manifest, "ckpt", 0)
    check_owner(Manifest(iteration=None, step=0, world_size=4, files=[]), "ckpt", 0)


def test_folder_key() -> None:
    assert folder_key("s3://bucket/run/") == "s3://bucket/run"
    assert folder_key("run/./ckpt/") == os.path.join(os.getcwd(), "run", "ckpt")
