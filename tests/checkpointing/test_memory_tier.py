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
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator
from accelkit.checkpointing.catalog.listing import COMMITTED, list_checkpoints
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.memory.peer import held_source, holder, pack, unpack
from accelkit.checkpointing.storage import get_storage
from accelkit.errors import ConfigurationError
from accelkit.runtime.job_memory import ENV_MEMORY_DIR
from accelkit.utils import ProjectConfiguration, set_seed
from tests.helpers.distributed import run_distributed


def _job(
    project: str,
    steps: int,
    every: int | None = 3,
    load: bool = False,
    save_at: tuple[int, ...] = (),
    before_load: Any = None,
    log_with: str | None = None,
) -> dict[str, Any]:
    """Train a small model for ``steps`` optimizer steps (resuming with ``load_state()`` first
    when ``load``); what it ended with."""
    set_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project,
            automatic_checkpoint_naming=True,
            memory_snapshot_every_steps=every,
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
        loaded = accelerator.load_state()
    gs = accelerator.gradient_state
    while gs.optimizer_steps < steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if gs.optimizer_steps in save_at:
                accelerator.save_state()
            if gs.optimizer_steps >= steps:
                break
    accelerator.wait_for_checkpoints()
    folder = os.environ.get(ENV_MEMORY_DIR, "")
    mine = Path(folder) / f"rank_{accelerator.process_index}"
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
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setenv(ENV_MEMORY_DIR, str(folder))
    return folder


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


def test_the_trackers_load_event_names_the_memory_tier(tmp_path: Path, memory: Path) -> None:
    project = tmp_path / "p"
    _job(str(project), steps=7, log_with="jsonl")
    _job(str(project), steps=9, load=True, log_with="jsonl")
    lines = (project / "run" / "metrics.jsonl").read_text().splitlines()
    loads = [json.loads(line) for line in lines if '"checkpoint_load"' in line]
    assert [(e["path"], e["reason"]) for e in loads] == [
        (str(memory / "rank_0" / "snapshot_6"), "memory")
    ]


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
    (memory / "rank_0").write_text("in the way")
    with caplog.at_level(logging.WARNING):
        out = _job(str(tmp_path / "p"), steps=11, save_at=(10,))
    assert "The memory snapshot" in caplog.text and "failed" in caplog.text
    assert sorted(os.listdir(tmp_path / "p" / "checkpoints")) == ["checkpoint_0"]
    assert out["iteration"] == 1


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
        before_load=None if shm is None else _lose(shm, lose),
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
    shm = tmp_path / "shm-a"
    # Each process keeps its peer's newest snapshot (a ring of 2: each other's).
    assert sorted(os.listdir(shm / "copies")) == ["rank_0", "rank_1"]
    assert os.listdir(shm / "copies" / "rank_1") == ["snapshot_9"]
    # Each process restores its own snapshot of the same step.
    resumed = job("a", 14, True)
    assert [r["loaded"] for r in resumed] == [str(shm / f"rank_{r}" / "snapshot_9") for r in (0, 1)]
    assert _equal(resumed, reference)
    # Rank 1's own snapshots are gone (a machine lost): rank 0's copy brings step 9 back.
    job("b", 11, False)
    shm = tmp_path / "shm-b"
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
