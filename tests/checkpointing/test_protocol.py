"""The commit sequence on its own, with an in-process fake coordinator of two "processes".

Every phase (prepare, capture, write, commit, done) is exercised with a failure on the *other*
process: a failed step there, or that process vanishing. Files are real (``gatedfile://``, the
local disk with injectable write failures); the payloads are the real writers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit.checkpointing.commit.lock import LOCK_NAME, RunLock
from accelkit.checkpointing.commit.payload import LivePayload
from accelkit.checkpointing.commit.protocol import PHASES, SaveRequest, SaveSequence
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.formats.manifest import FileEntry, file_checksum
from accelkit.checkpointing.objects.contents import Snapshot
from accelkit.checkpointing.storage import Storage, get_storage, join
from tests.checkpointing.fake_coordinator import FakeCoordinator, FakeGroup, run_ranks
from tests.checkpointing.gatedfs import GatedFileSystem, gated_url

pytestmark = pytest.mark.usefixtures("open_gate")


@dataclass
class ShardedStandIn(LivePayload):
    """A payload with sharded state, whose collective write is recorded (DCP needs a real
    process group; the sequence only needs the files it reports)."""

    rank: int = 0
    calls: list[Any] = field(default_factory=list)

    @property
    def has_sharded(self) -> bool:
        return True

    def write_sharded(self, storage: Storage, folder: str, group: Any) -> list[FileEntry]:
        self.calls.append(group)
        rel = f"sharded/__{self.rank}_0.distcp"
        storage.makedirs(join(folder, "sharded"))
        storage.write_bytes(join(folder, rel), b"shard %d" % self.rank)
        size, checksum = file_checksum(storage, join(folder, rel), "sha256")
        return [FileEntry(rel, size, checksum)]


@dataclass
class Run:
    project: str
    target: str
    retention_saw: list[tuple[bool, bool]] = field(default_factory=list)
    payloads: dict[int, LivePayload] = field(default_factory=dict)

    @property
    def local_target(self) -> Path:
        return Path(self.target.split("://", 1)[1])

    @property
    def lock_file(self) -> Path:
        return Path(self.project.split("://", 1)[1]) / LOCK_NAME

    def committed(self) -> bool:
        return (self.local_target / "accelkit.json").exists()


def _run(tmp_path: Path, automatic: bool = True) -> Run:
    project = gated_url(tmp_path / "project")
    name = "checkpoint_0" if automatic else "explicit"
    return Run(project, join(project, "checkpoints", name))


def _save(
    run: Run,
    hub: FakeGroup,
    automatic: bool = True,
    fail_capture: int | None = None,
    sharded: bool = False,
) -> list[Any]:
    def retention(target: str) -> None:
        run.retention_saw.append((run.committed(), run.lock_file.exists()))

    def payload(rank: int) -> LivePayload:
        if rank == fail_capture:
            raise RuntimeError(f"capture broke on rank {rank}")
        models = [("model", {"w": torch.full((4,), float(rank))})] if rank == 0 else []
        contents = Snapshot(models=models, states=[(f"random_states_{rank}", {"seed": rank})])
        made = ShardedStandIn(contents, rank=rank) if sharded else LivePayload(contents)
        run.payloads[rank] = made
        return made

    def body(rank: int, coordinator: FakeCoordinator) -> str:
        lock = RunLock(get_storage(run.project), run.project) if automatic else None
        request = SaveRequest(run.target, automatic, iteration=0, step=7)
        sequence = SaveSequence(
            coordinator, get_storage(run.target), request, lock=lock, retention=retention
        )
        sequence.prepare()
        sequence.capture(lambda: payload(rank))
        sequence.finish()
        return "ok"

    return run_ranks(hub, body)


def test_success_runs_every_phase_once_in_order(tmp_path: Path) -> None:
    run, hub = _run(tmp_path), FakeGroup(2)
    assert _save(run, hub) == ["ok", "ok"]
    assert hub.phases == [list(PHASES), list(PHASES)]
    manifest = json.loads((run.local_target / "accelkit.json").read_text())
    files = {f["path"] for f in manifest["files"]}
    assert {"model.safetensors", "random_states_0.json", "random_states_1.json"} <= files
    assert manifest["world_size"] == 2 and manifest["step"] == 7
    # Retention ran once, on the main process, after the commit and before the release.
    assert run.retention_saw == [(True, True)]
    assert not run.lock_file.exists()


def test_failed_prepare_on_the_main_process_reaches_the_other(tmp_path: Path) -> None:
    run, hub = _run(tmp_path), FakeGroup(2)
    run.local_target.mkdir(parents=True)
    (run.local_target / "keep.txt").write_text("mine")
    main, other = _save(run, hub)
    assert isinstance(main, CheckpointError) and "already exists" in str(main)
    assert isinstance(other, CheckpointError)
    assert "failed on process 0 while preparing" in str(other) and "already exists" in str(other)
    assert hub.phases == [["prepare"], ["prepare"]]
    assert (run.local_target / "keep.txt").read_text() == "mine"  # never touched
    assert not run.lock_file.exists()


@pytest.mark.parametrize("phase", ["capture", "write"])
def test_a_failure_on_the_other_process_commits_nothing(tmp_path: Path, phase: str) -> None:
    run, hub = _run(tmp_path), FakeGroup(2)
    if phase == "write":
        GatedFileSystem.fail_on = "random_states_1"
    main, other = _save(run, hub, fail_capture=1 if phase == "capture" else None)
    doing = {"capture": "capturing its state", "write": "writing its files"}[phase]
    assert isinstance(main, CheckpointError), main
    assert f"failed on process 1 while {doing}" in str(main) and "not committed" in str(main)
    assert isinstance(other, CheckpointError) and "process 1" in str(other)
    assert hub.phases[0] == list(PHASES[: PHASES.index(phase) + 1])
    assert not run.local_target.exists()  # the spent automatic folder is removed
    assert not run.lock_file.exists() and run.retention_saw == []


def test_a_failed_commit_on_the_main_process_reaches_the_other(tmp_path: Path) -> None:
    run, hub = _run(tmp_path), FakeGroup(2)
    GatedFileSystem.fail_on = "accelkit.json"
    main, other = _save(run, hub)
    assert isinstance(other, CheckpointError)
    assert "failed on process 0 while committing" in str(other)
    assert isinstance(main, CheckpointError) and "injected write failure" in str(main)
    assert not run.local_target.exists() and not run.lock_file.exists()
    assert run.retention_saw == []


@pytest.mark.parametrize("phase", PHASES)
def test_the_other_process_vanishing_at_any_phase(tmp_path: Path, phase: str) -> None:
    run, hub = _run(tmp_path), FakeGroup(2)
    hub.lose = {1: phase}
    main, _ = _save(run, hub)
    assert isinstance(main, CheckpointError), main
    assert "lost contact with the other processes" in str(main)
    # The main process commits before the commit phase's exchange: a checkpoint is then
    # complete (every process's files were exchanged) and says so.
    committed = phase in ("commit", "done")
    assert run.committed() == committed
    assert ("It was committed" in str(main)) == committed
    assert not run.lock_file.exists()  # given back in every case
    if phase in ("capture", "write"):
        assert not run.local_target.exists()


def test_sharded_state_is_written_only_once_every_process_captured(tmp_path: Path) -> None:
    run, hub = _run(tmp_path, automatic=False), FakeGroup(2)
    stale = run.local_target / "sharded" / "__7_0.distcp"  # of an earlier, larger world
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    main, other = _save(run, hub, automatic=False, sharded=True, fail_capture=1)
    assert isinstance(main, CheckpointError) and isinstance(other, CheckpointError)
    assert run.payloads[0].calls == []  # type: ignore[attr-defined]  # never entered

    assert _save(run, FakeGroup(2), automatic=False, sharded=True) == ["ok", "ok"]
    assert [p.calls for p in run.payloads.values()] == [[None], [None]]  # type: ignore[attr-defined]
    manifest = json.loads((run.local_target / "accelkit.json").read_text())
    files = {f["path"] for f in manifest["files"]}
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= files
    assert not stale.exists()  # cleared by the main process before the write


def test_an_explicit_folder_is_uncommitted_then_rewritten(tmp_path: Path) -> None:
    run = _run(tmp_path, automatic=False)
    assert _save(run, FakeGroup(2), automatic=False) == ["ok", "ok"]
    (run.local_target / "random_states_5.json").write_text("{}")  # from a larger earlier run
    GatedFileSystem.fail_on = "random_states_1"
    main, _ = _save(run, FakeGroup(2), automatic=False)
    assert isinstance(main, CheckpointError)
    assert not run.committed() and run.local_target.exists()  # un-committed, not removed
    GatedFileSystem.fail_on = None
    assert _save(run, FakeGroup(2), automatic=False) == ["ok", "ok"]
    assert run.committed() and not (run.local_target / "random_states_5.json").exists()
    assert run.retention_saw == []  # explicit folders are never retained


def test_an_interrupted_capture_gives_the_lock_back(tmp_path: Path) -> None:
    """Ctrl-C while a pre-hook runs: the caller gets the interrupt, the folder and the lock
    are not left behind."""
    run = _run(tmp_path)
    hub = FakeGroup(1)
    lock = RunLock(get_storage(run.project), run.project)
    request = SaveRequest(run.target, True, iteration=0)
    sequence = SaveSequence(hub.coordinator(0), get_storage(run.target), request, lock=lock)
    sequence.prepare()
    assert run.lock_file.exists() and run.local_target.is_dir()

    def interrupted() -> LivePayload:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sequence.capture(interrupted)
    assert not run.lock_file.exists() and not run.local_target.exists()
