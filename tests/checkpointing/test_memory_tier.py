"""The memory tier (#39 item 1-2): snapshots every N optimizer steps in the job's shared memory,
and ``load_state()`` resolving the newest one every process has when it is newer than the disk.

The job's shared memory is what ``accelkit launch`` names in ``ACCELKIT_MEMORY_DIR``; here a
temporary folder stands for it (tests/cli/test_launch_memory_tier.py runs the launcher, a
worker SIGKILLed, and the restart). Multi-process cases run 2 real gloo processes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator
from accelkit.checkpointing.catalog.listing import COMMITTED, list_checkpoints
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.manifest import read_manifest, resumed_of
from accelkit.checkpointing.memory.peer import held_source, holder, pack, unpack
from accelkit.checkpointing.memory.promote import PROJECT_RECORD, promote_snapshots
from accelkit.checkpointing.memory.tier import project_key
from accelkit.checkpointing.storage import get_storage
from accelkit.cli.main import main
from accelkit.errors import ConfigurationError
from accelkit.runtime.job_memory import ENV_MEMORY_DIR
from accelkit.utils import ProjectConfiguration, set_seed
from tests.checkpointing.writer_gate import WriterGate
from tests.helpers.distributed import run_distributed


def _job(
    project: str,
    steps: int,
    every: int | None = 3,
    load: bool = False,
    save_at: tuple[int, ...] = (),
    before_load: Any = None,
    log_with: str | None = None,
    save_every: int | None = None,
    load_from: str | None = None,
) -> dict[str, Any]:
    """Train a small model for ``steps`` optimizer steps (resuming with ``load_state()`` first
    when ``load``); what it ended with."""
    set_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project,
            automatic_checkpoint_naming=True,
            memory_snapshot_every_steps=every,
            save_every_steps=save_every,
        ),
        log_with=log_with,
    )
    if log_with:
        accelerator.init_trackers("run")
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(256, 6), torch.randn(256, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loaded = None
    if load:
        if before_load is not None:
            before_load(accelerator.process_index)
        folder = None if load_from is None else os.path.join(project, "checkpoints", load_from)
        loaded = accelerator.load_state(folder)
    gs = accelerator.gradient_state
    while gs.optimizer_steps < steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            # Each snapshot written before the next save point (a save in flight there would
            # put the snapshot off: test_a_save_in_flight_puts_the_snapshot_off).
            accelerator.wait_for_checkpoints()
            if gs.optimizer_steps in save_at or accelerator.should_save():
                accelerator.save_state()
            if gs.optimizer_steps >= steps:
                break
    accelerator.wait_for_checkpoints()
    folder = os.environ.get(ENV_MEMORY_DIR, "")
    mine = Path(folder) / project_key(project) / f"rank_{accelerator.process_index}"
    snapshots = sorted(p.name for p in mine.iterdir()) if folder and mine.is_dir() else []
    result = {
        "loaded": loaded,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "snapshots": snapshots,
        "iteration": accelerator.project_configuration.iteration,
        "rng": torch.get_rng_state(),
    }
    accelerator.end_training()
    return result


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]) and (
        torch.equal(a["rng"], b["rng"])
    )


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The job's shared memory stood in by a folder; returned: the folder of project ``p``'s
    snapshots in it (each project has its own)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setenv(ENV_MEMORY_DIR, str(folder))
    return folder / project_key(str(tmp_path / "p"))


def test_snapshots_every_n_steps_keep_the_newest_and_never_move_the_counter(
    tmp_path: Path, memory: Path
) -> None:
    out = _job(str(tmp_path / "p"), steps=11, save_at=(5,))
    # Steps 3, 6, 9 snapshotted; the newest committed kept (and the one written after it).
    assert out["snapshots"] == ["snapshot_6", "snapshot_9"]
    infos = list_checkpoints(get_storage(str(memory / "rank_0")), str(memory / "rank_0"))
    assert {i.name: (i.state, i.step) for i in infos}["snapshot_9"] == (COMMITTED, 9)
    manifest = infos[-1].manifest
    assert manifest is not None and manifest.reason == "memory"
    # The one save_state() is checkpoint_0: snapshots take no number.
    assert sorted(os.listdir(tmp_path / "p" / "checkpoints")) == ["checkpoint_0"]
    assert out["iteration"] == 1


def test_a_restart_resumes_from_the_newest_snapshot_bit_for_bit(
    tmp_path: Path, memory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    project = str(tmp_path / "p")
    _job(project, steps=11, save_at=(5,))  # "crashes" after step 11: snapshot 9 is newest
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.memory"):
        resumed = _job(project, steps=20, load=True)
    assert resumed["loaded"] == str(memory / "rank_0" / "snapshot_9")
    assert "restored the memory snapshot of step 9 (newer than step 5 on disk)" in caplog.text
    # The counter is where the uninterrupted run's is: past checkpoint_0, not past the snapshot.
    assert resumed["iteration"] == 1
    reference = _job(str(tmp_path / "ref"), steps=20, every=None, save_at=(5,))
    assert _same(resumed, reference)


def test_a_checkpoint_on_disk_as_new_as_the_snapshot_wins(tmp_path: Path, memory: Path) -> None:
    project = str(tmp_path / "p")
    _job(project, steps=9, save_at=(9,))  # snapshot_9 is taken after checkpoint_0 of step 9
    resumed = _job(project, steps=12, load=True)
    assert resumed["loaded"] == str(Path(project) / "checkpoints" / "checkpoint_0")


def test_a_damaged_snapshot_falls_back_to_the_next_one_that_loads(
    tmp_path: Path, memory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    project = str(tmp_path / "p")
    _job(project, steps=11, save_at=(5,))
    model = memory / "rank_0" / "snapshot_9" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x10  # one bit of a weight: only the checksum sees it
    model.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        resumed = _job(project, steps=20, load=True)
    # The next older snapshot (step 6) is still newer than the disk's checkpoint (step 5).
    assert resumed["loaded"] == str(memory / "rank_0" / "snapshot_6")
    assert "Not resuming from the memory snapshot of step 9: it is damaged" in caplog.text
    reference = _job(str(tmp_path / "ref"), steps=20, every=None, save_at=(5,))
    assert _same(resumed, reference)


def test_a_script_that_never_saved_resumes_from_memory_alone(tmp_path: Path, memory: Path) -> None:
    # No checkpoint on disk at all (the crash came before the first save_state()).
    project = str(tmp_path / "p")
    _job(project, steps=7)
    resumed = _job(project, steps=12, load=True)
    assert resumed["loaded"] == str(memory / "rank_0" / "snapshot_6")
    assert _same(resumed, _job(str(tmp_path / "ref"), steps=12, every=None))


def test_the_trackers_load_event_and_ckpt_ls_name_the_memory_tier(
    tmp_path: Path, memory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "p"
    _job(str(project), steps=7, log_with="jsonl", save_at=(2,))
    _job(str(project), steps=9, load=True, log_with="jsonl", save_at=(8,))
    lines = (project / "run" / "metrics.jsonl").read_text().splitlines()
    loads = [json.loads(line) for line in lines if '"checkpoint_load"' in line]
    assert [(e["path"], e["reason"], e["tier"]) for e in loads] == [
        (str(memory / "rank_0" / "snapshot_6"), "memory", "memory")
    ]
    # The checkpoint the restored job saved says where its state came from; the one saved
    # before the crash says nothing (that job started fresh).
    local = get_storage(str(project))
    first, second = (
        read_manifest(local, str(project / "checkpoints" / f"checkpoint_{i}")) for i in (0, 1)
    )
    assert first is not None and resumed_of(first) == {}
    assert second is not None
    assert resumed_of(second) == {"tier": "memory", "checkpoint": "snapshot_6", "step": 6}
    capsys.readouterr()
    assert main(["ckpt", "ls", str(project)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "RESUMED" in table[0].split()
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert "memory:snapshot_6" in rows["checkpoint_1"]
    assert not any(cell.startswith("memory:") for cell in rows["checkpoint_0"])


def test_outside_accelkit_launch_the_setting_says_why_nothing_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV_MEMORY_DIR, raising=False)
    with caplog.at_level(logging.WARNING):
        out = _job(str(tmp_path / "p"), steps=4)
    assert "no memory snapshots are taken" in caplog.text and "accelkit launch" in caplog.text
    assert out["snapshots"] == []


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "10"])
def test_a_bad_interval_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ConfigurationError, match=r"memory_snapshot_every_steps=.*for no memory"):
        ProjectConfiguration(memory_snapshot_every_steps=value)


def test_the_options_object_and_the_flat_name_are_one_setting() -> None:
    config = ProjectConfiguration(memory={"every_steps": 50})
    assert config.memory_snapshot_every_steps == 50
    config.memory_snapshot_every_steps = 7
    assert config.memory.every_steps == 7


def test_a_failed_snapshot_never_stops_training_nor_fails_the_next_save(
    tmp_path: Path, memory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The process's snapshot folder is a file: every snapshot fails in the writer.
    # A file where the first snapshot's folder goes: that snapshot fails in its writer.
    (memory / "rank_0").mkdir(parents=True)
    (memory / "rank_0" / "snapshot_3").write_text("in the way")
    with caplog.at_level(logging.WARNING):
        out = _job(str(tmp_path / "p"), steps=11, save_at=(10,))
    assert "The memory snapshot" in caplog.text and "failed" in caplog.text
    assert sorted(os.listdir(tmp_path / "p" / "checkpoints")) == ["checkpoint_0"]
    assert out["iteration"] == 1


@pytest.mark.parametrize("failing", [False, True])
def test_a_save_in_flight_puts_the_snapshot_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: bool
) -> None:
    # The script's asynchronous save is held in its writer (or fails there): the snapshot
    # points meanwhile take no snapshot, the steps do not wait for the write, and the save's
    # failure reaches the script where it would without the tier (its own wait), not its loop.
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(ENV_MEMORY_DIR, str(shm))
    gate = WriterGate("thread")
    project = gate.url(tmp_path / "p")
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project,
            automatic_checkpoint_naming=True,
            memory_snapshot_every_steps=2,
            async_writer="thread",
        )
    )
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    mine = shm / project_key(project) / "rank_0"
    steps = accelerator.gradient_state
    try:
        if failing:
            gate.fail(accelerator, "model")
        else:
            gate.hold(accelerator)
        handle = None
        for x, y in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if steps.optimizer_steps == 1:
                handle = accelerator.save_state(async_save=True)
                assert failing or gate.waiting()
            if steps.optimizer_steps == 8:
                break
        # Steps 2 to 8 ran with the save held (or failed and not yet told): no snapshot.
        assert not mine.exists() or not os.listdir(mine)
        if failing:
            with pytest.raises(CheckpointError, match=gate.failure_text):
                accelerator.wait_for_checkpoints()
        else:
            gate.release()
            assert handle is not None and handle.result()
        for x, y in loader:  # the next save point (this pass's start) takes the snapshot
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            break
        accelerator.wait_for_checkpoints()
        assert os.listdir(mine) == ["snapshot_8"]
    finally:
        gate.reset()
        accelerator.end_training()


def test_a_rollback_removes_the_snapshots_of_the_trajectory_it_left(
    tmp_path: Path, memory: Path
) -> None:
    project = str(tmp_path / "p")
    _job(project, steps=11, save_at=(4,))  # snapshots 6 and 9, checkpoint_0 of step 4

    # A new job goes back to step 4 on purpose, then "crashes" at step 8 (snapshot 7 only).
    out = _job(project, steps=8, load=True, load_from="checkpoint_0")
    assert out["snapshots"] == ["snapshot_7"]
    # Its restart resumes the new trajectory (step 7), not the abandoned one (step 9).
    resumed = _job(project, steps=9, load=True)
    assert resumed["loaded"] == str(memory / "rank_0" / "snapshot_7")


def test_a_run_restored_from_memory_saves_on_the_uninterrupted_runs_steps(
    tmp_path: Path, memory: Path
) -> None:
    # save_every_steps=5: the uninterrupted run saves at 5, 10, 15. A run restored from the
    # snapshot of step 12 (last save: 10) saves at 15 too, not at 17.
    project = tmp_path / "p"
    _job(str(project), steps=13, every=3, save_every=5)
    _job(str(project), steps=16, load=True, every=3, save_every=5)
    steps = sorted(
        json.loads((folder / "accelkit.json").read_text())["step"]
        for folder in (project / "checkpoints").iterdir()
    )
    assert steps == [5, 10, 15]


def test_another_projects_snapshots_are_never_restored(tmp_path: Path, memory: Path) -> None:
    # Two runs one after the other in one job (a sweep): the second, in its own project_dir,
    # starts fresh instead of restoring the first one's snapshot.
    _job(str(tmp_path / "p"), steps=11)
    with pytest.raises(CheckpointPathError):
        _job(str(tmp_path / "q"), steps=4, load=True)


def test_a_memory_folder_in_the_way_falls_back_to_the_disk(tmp_path: Path, memory: Path) -> None:
    project = str(tmp_path / "p")
    memory.mkdir()
    (memory / "rank_0").write_text("not a folder")
    _job(project, steps=6, save_at=(5,))
    resumed = _job(project, steps=8, load=True)
    assert resumed["loaded"] == str(Path(project) / "checkpoints" / "checkpoint_0")


def test_a_crafted_snapshot_is_not_restored_and_a_link_is_not_followed(
    tmp_path: Path, memory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    project = str(tmp_path / "p")
    _job(project, steps=11, save_at=(5,))
    # A copy of snapshot_9 named for a later step: its name and manifest disagree.
    shutil.copytree(memory / "rank_0" / "snapshot_9", memory / "rank_0" / "snapshot_999")
    resumed = _job(project, steps=12, load=True)
    assert resumed["loaded"] == str(memory / "rank_0" / "snapshot_9")
    # The process's folder replaced by a link to a folder with someone's files: the tier
    # neither reads nor deletes through it; training goes on from the disk.
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "snapshot_1").mkdir(parents=True)
    (elsewhere / "snapshot_1" / "precious").write_text("keep")
    shutil.rmtree(memory / "rank_0")
    (memory / "rank_0").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        out = _job(project, steps=16, load=True)
    assert out["loaded"] == str(Path(project) / "checkpoints" / "checkpoint_0")
    assert (elsewhere / "snapshot_1" / "precious").read_text() == "keep"
    assert sorted(os.listdir(elsewhere)) == ["snapshot_1"]  # nothing written through it
    assert "Memory snapshots are off for this run" in caplog.text


# ---------------------------------------------------------------------- two processes


def _lose(shm: str, folders: tuple[str, ...]) -> Any:
    def before_load(rank: int) -> None:
        if rank == 1:  # rank 1 is restarted on a machine that lost ``folders``
            import shutil

            for folder in folders:
                shutil.rmtree(os.path.join(shm, folder))

    return before_load


def _two(
    project: str, steps: int, load: bool, shm: str | None = None, lose: tuple[str, ...] = ()
) -> dict[str, Any]:
    out = _job(
        project,
        steps,
        load=load,
        save_at=(5,),
        before_load=None if shm is None else _lose(os.path.join(shm, project_key(project)), lose),
    )
    return {k: out[k] for k in ("loaded", "snapshots")} | {"w": out["weights"], "rng": out["rng"]}


def _equal(got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> bool:
    return all(
        all(torch.equal(got[r]["w"][k], reference[r]["w"][k]) for k in got[r]["w"])
        and torch.equal(got[r]["rng"], reference[r]["rng"])
        for r in (0, 1)
    )


@pytest.mark.slow
def test_two_processes_agree_on_a_snapshot_and_bring_lost_ones_back_from_peers(
    tmp_path: Path,
) -> None:
    def job(name: str, steps: int, load: bool, lose: tuple[str, ...] = ()) -> list[Any]:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir(exist_ok=True)
        return run_distributed(
            _two, str(tmp_path / name), steps, load, str(shm), lose, env={ENV_MEMORY_DIR: str(shm)}
        )

    reference = run_distributed(_two, str(tmp_path / "ref"), 14, False, env={})
    first = job("a", 11, False)
    assert [r["snapshots"] for r in first] == [["snapshot_6", "snapshot_9"]] * 2
    shm = tmp_path / "shm-a" / project_key(str(tmp_path / "a"))
    # Each process keeps its peer's newest snapshot (a ring of 2: each other's).
    assert sorted(os.listdir(shm / "copies")) == ["rank_0", "rank_1"]
    assert os.listdir(shm / "copies" / "rank_1") == ["snapshot_9"]
    # Each process restores its own snapshot of the same step.
    resumed = job("a", 14, True)
    assert [r["loaded"] for r in resumed] == [str(shm / f"rank_{r}" / "snapshot_9") for r in (0, 1)]
    assert _equal(resumed, reference)
    # Rank 1's own snapshots are gone (a machine lost): rank 0's copy brings step 9 back.
    job("b", 11, False)
    shm = tmp_path / "shm-b" / project_key(str(tmp_path / "b"))
    back = job("b", 14, True, ("rank_1",))
    assert [r["loaded"] for r in back] == [str(shm / f"rank_{r}" / "snapshot_9") for r in (0, 1)]
    assert _equal(back, reference)
    # Its copies too: no step every process can have, so both take the disk.
    job("c", 11, False)
    lost = job("c", 14, True, ("rank_1", "copies/rank_1"))
    disk = str(tmp_path / "c" / "checkpoints" / "checkpoint_0")
    assert [r["loaded"] for r in lost] == [disk, disk]
    assert _equal(lost, reference)


# ---------------------------------------------------------------------- peer copies


def test_the_ring_keeps_each_copy_one_machine_away() -> None:
    # 2 machines of 4 processes: rank 1's copy is kept by rank 5, on the other machine.
    assert [holder(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [held_source(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    # One machine: the next process.
    assert [holder(r, 3, 3) for r in range(3)] == [1, 2, 0]
    assert [held_source(r, 3, 3) for r in range(3)] == [2, 0, 1]


def test_a_copy_round_trips_and_a_crafted_one_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "accelkit.json").write_text("{}")
    (src / "sub" / "model.safetensors").write_bytes(b"\x01" * 100)
    header_len, payload = pack(str(src))
    unpack(header_len, memoryview(payload), str(tmp_path / "dst"))
    assert (tmp_path / "dst" / "sub" / "model.safetensors").read_bytes() == b"\x01" * 100
    body = bytes(payload[header_len:])
    for entries, match in [
        ([["../escaped", len(body)]], "leaves the folder"),
        ([["/etc/escaped", len(body)]], "leaves the folder"),
        ([["a", len(body) + 1]], "add up"),
        ([["a", -1], ["b", len(body) + 1]], "add up"),
        ({"a": 1}, "malformed"),
    ]:
        header = json.dumps(entries).encode()
        crafted = memoryview(bytearray(header + body))
        with pytest.raises(CorruptCheckpointError, match=match):
            unpack(len(header), crafted, str(tmp_path / "crafted"))
        assert not any(p.name.startswith("crafted") for p in tmp_path.iterdir())
    assert not (tmp_path.parent / "escaped").exists()


def _promote(shm: Path) -> tuple[list[str], list[str]]:
    said: list[str] = []
    return promote_snapshots(str(shm), said.append), said


def test_a_failed_jobs_newest_snapshot_is_committed_and_resumed_bit_for_bit(
    tmp_path: Path, memory: Path
) -> None:
    project = tmp_path / "p"
    _job(str(project), steps=11, save_at=(5,))  # "fails" after step 11: snapshot 9 is newest
    committed, said = _promote(memory.parent)
    target = project / "checkpoints" / "checkpoint_1"
    assert committed == [str(target)]
    assert said == [
        f"committed the memory snapshot of step 9 as {target} (newer than step 5 on disk): "
        "the next load_state() resumes from it"
    ]
    manifest = read_manifest(get_storage(str(target)), str(target))
    assert manifest is not None and manifest.process_index is None
    assert (manifest.step, manifest.iteration, manifest.reason) == (9, 1, "memory")
    shutil.rmtree(memory.parent)  # the job's memory goes with the job
    resumed = _job(str(project), steps=20, load=True, every=None)
    assert resumed["loaded"] == str(target)
    assert _same(resumed, _job(str(tmp_path / "ref"), steps=20, every=None, save_at=(5,)))
    assert _promote(memory.parent) == ([], [])  # the job's memory is gone: nothing to say


def test_a_damaged_snapshot_is_not_committed_and_the_next_older_one_is(
    tmp_path: Path, memory: Path
) -> None:
    project = tmp_path / "p"
    _job(str(project), steps=11, save_at=(5,))
    model = memory / "rank_0" / "snapshot_9" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x10
    model.write_bytes(bytes(data))
    committed, said = _promote(memory.parent)
    assert committed == [str(project / "checkpoints" / "checkpoint_1")]
    assert said[0].startswith("the memory snapshot of step 9 was not committed to disk (")
    assert "checksum" in said[0]
    assert "committed the memory snapshot of step 6" in said[1]
    # The attempt at step 9 left nothing behind: checkpoint_1 is the one of step 6.
    infos = list_checkpoints(get_storage(str(project)), str(project / "checkpoints"))
    assert [(i.name, i.step, i.state) for i in infos] == [
        ("checkpoint_0", 5, COMMITTED),
        ("checkpoint_1", 6, COMMITTED),
    ]


def test_nothing_is_committed_when_the_disk_is_as_new_or_the_record_is_not_ours(
    tmp_path: Path, memory: Path
) -> None:
    project = tmp_path / "p"
    _job(str(project), steps=9, save_at=(9,))  # checkpoint_0 of step 9, as new as the snapshot
    assert _promote(memory.parent) == ([], [])
    shutil.rmtree(project / "checkpoints")  # now the snapshot would be committed, but:
    record = memory / PROJECT_RECORD
    for crafted in ('{"project_dir": 5, "world_size": 1}', "[]", "not json", '{"world_size": 1}'):
        record.write_text(crafted)
        assert _promote(memory.parent) == ([], [])
        assert not (project / "checkpoints").exists()
    record.write_text(json.dumps({"project_dir": str(project), "world_size": 2}))
    assert _promote(memory.parent) == ([], [])  # rank 1 has no snapshot: no complete set


def test_a_folder_that_takes_the_number_meanwhile_is_left_alone(
    tmp_path: Path, memory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer creates checkpoint_1 between the listing and the claim: the promotion
    # neither writes into it nor removes it.
    from accelkit.checkpointing.memory import promote

    project = tmp_path / "p"
    _job(str(project), steps=11, save_at=(5,))
    theirs = project / "checkpoints" / "checkpoint_1"
    theirs.mkdir()
    (theirs / "theirs.txt").write_text("not yours")
    monkeypatch.setattr(promote, "next_iteration", lambda infos: 1)
    committed, said = _promote(memory.parent)
    assert committed == [] and len(said) == 1 and "were not committed to disk" in said[0]
    assert sorted(p.name for p in theirs.iterdir()) == ["theirs.txt"]
