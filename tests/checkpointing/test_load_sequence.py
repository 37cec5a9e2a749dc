"""The load sequence, phase by phase, on real checkpoints on the local disk.

Checkpoints are written by a real ``Accelerator`` (accelkit's own) or by hand in the files Hugging
Face accelerate's ``save_state`` writes; the sequence runs with the real readers. The stand-ins
are the run around it: a single process that records when the processes meet, and a counter
that records when it moves.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog.listing import ACCELERATE, COMMITTED
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.interop.accelerate_format import AccelerateReader
from accelkit.checkpointing.listener import CommitReport, LoadReport, SafeListener
from accelkit.checkpointing.objects.contents import TrainingObjects
from accelkit.checkpointing.objects.fingerprint import Fingerprint
from accelkit.checkpointing.restore.native import NativeReader
from accelkit.checkpointing.restore.sequence import (
    PHASES,
    FolderReader,
    LoadSequence,
    LoadSource,
    OpenReader,
)
from accelkit.checkpointing.storage import Storage, get_storage


class Box:
    """A registered object; ``refuse`` makes its ``load_state_dict`` fail (in the apply phase)."""

    def __init__(self, value: float = 0.0, refuse: bool = False) -> None:
        self.value = value
        self.refuse = refuse

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if self.refuse:
            raise ValueError("this Box refuses every state")
        self.value = state["value"]


class OneProcess:
    """This process alone; ``meet`` records that the processes met (or fails, like a process
    that lost its peers)."""

    def __init__(self, events: list[str], lost: bool = False) -> None:
        self.events = events
        self.lost = lost
        self.process_index = 0
        self.num_processes = 1
        self.is_main_process = True

    def wait_for_everyone(self) -> None:
        if self.lost:
            raise RuntimeError("the other processes are gone")
        self.events.append("meet")


class Counter:
    """A run counter that records each move."""

    def __init__(self, events: list[str], value: int = 0) -> None:
        self.events = events
        self.value = value

    def set(self, value: int) -> None:
        self.events.append(f"counter={value}")
        self.value = value


class Recording:
    """Wraps a real reader and records when the sequence calls it."""

    def __init__(self, reader: FolderReader, events: list[str]) -> None:
        self.reader = reader
        self.events = events

    def check(self, objects: TrainingObjects) -> None:
        self.events.append("check")
        self.reader.check(objects)

    def read(self, objects: TrainingObjects) -> None:
        self.events.append("read")
        self.reader.read(objects)

    def apply(self) -> Manifest:
        self.events.append("apply")
        return self.reader.apply()

    @property
    def fingerprint(self) -> Fingerprint | None:
        return self.reader.fingerprint


def _recorded(open_reader: OpenReader, events: list[str]) -> OpenReader:
    def open_recorded(source: LoadSource) -> FolderReader:
        events.append(f"open {source.info.state}")
        return Recording(open_reader(source), events)

    return open_recorded


class Run:
    """Live objects to restore, and a sequence to restore them with."""

    def __init__(self, project: Path, seed: int = 1, box: Box | None = None) -> None:
        torch.manual_seed(seed)
        self.project = project
        self.model = nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.box = box or Box(-1.0)
        self.events: list[str] = []
        self.counter = Counter(self.events)
        self.before = self.weights()

    def objects(self) -> TrainingObjects:
        return TrainingObjects(models=[self.model], optimizers=[self.optimizer], custom=[self.box])

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def unchanged(self) -> bool:
        now = self.model.state_dict()
        return all(torch.equal(now[k], v) for k, v in self.before.items())

    def sequence(
        self,
        readers: Mapping[str, OpenReader] | None = None,
        lost: bool = False,
        storage_for: Any = None,
    ) -> LoadSequence:
        if readers is None:
            readers = {COMMITTED: NativeReader, ACCELERATE: AccelerateReader}
        recorded = {state: _recorded(r, self.events) for state, r in readers.items()}

        def hook(models: list[nn.Module], path: str) -> None:
            self.events.append(f"hook {len(models)}")

        return LoadSequence(
            OneProcess(self.events, lost=lost),
            storage_for or get_storage,
            recorded,
            self.counter,
            root=str(self.project / "checkpoints"),
            hooks=[hook],
            verify=True,
        )


def _saved(project: Path, count: int = 1) -> tuple[list[str], dict[str, torch.Tensor]]:
    """``count`` accelkit checkpoints of one model, its optimizer and a Box(1.0) (the last
    one's weights are returned)."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(Box(1.0))
    paths = []
    for _ in range(count):
        with torch.no_grad():
            model.weight.add_(1.0)
        paths.append(accelerator.save_state())
    return paths, {k: v.clone() for k, v in model.state_dict().items()}


def _accelerate_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The files accelerate's ``save_state`` writes for one model, optimizer and registered
    object on one process; returns the saved weights."""
    folder.mkdir(parents=True)
    torch.manual_seed(7)
    model = nn.Linear(3, 2)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    torch.save({"value": 2.0}, folder / "custom_checkpoint_0.pkl")
    states = {
        "step": 5,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(states, folder / "random_states_0.pkl")
    return weights


def _note(error: BaseException) -> str:
    return " ".join(getattr(error, "__notes__", []))


# --------------------------------------------------------------------------- in order


def test_the_native_reader_goes_through_every_phase_in_order(tmp_path: Path) -> None:
    project = tmp_path / "run"
    (path,), saved = _saved(project)
    run = Run(project)
    sequence = run.sequence()
    result = sequence.run(path, run.objects())
    assert sequence.completed == list(PHASES)
    assert run.events == [
        "open committed",
        "check",
        "hook 1",  # the load pre-hooks open the read phase
        "read",
        "apply",
        "counter=1",  # past checkpoint_0
        "meet",
    ]
    assert result.path == path and result.manifest.iteration == 0
    assert all(torch.equal(run.model.state_dict()[k], v) for k, v in saved.items())
    assert run.box.value == 1.0


def test_the_accelerate_reader_goes_through_the_same_phases(tmp_path: Path) -> None:
    project = tmp_path / "run"
    folder = project / "checkpoints" / "checkpoint_4"
    saved = _accelerate_folder(folder)
    run = Run(project)
    sequence = run.sequence()
    result = sequence.run(str(folder), run.objects())
    assert sequence.completed == list(PHASES)
    assert run.events == [
        "open accelerate",
        "check",
        "hook 1",
        "read",
        "apply",
        "counter=5",  # through IterationCounter.set, like a native load
        "meet",
    ]
    assert result.manifest.step == 5 and result.manifest.metadata == {"format": "accelerate"}
    assert all(torch.equal(run.model.state_dict()[k], v) for k, v in saved.items())
    assert run.box.value == 2.0


def test_without_a_folder_the_newest_that_loads_is_resolved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    project = tmp_path / "run"
    paths, _ = _saved(project, count=2)
    (Path(paths[1]) / "model.safetensors").write_bytes(b"damaged")
    run = Run(project)
    sequence = run.sequence()
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.restore.sequence"):
        result = sequence.run(None, run.objects())
    assert result.path == paths[0]
    assert f"Not resuming from {paths[1]}" in caplog.text
    assert sequence.completed == list(PHASES)
    assert run.events[-2:] == ["counter=2", "meet"]  # past both folders
    assert Path(paths[1]).exists()  # a damaged checkpoint is never deleted


# --------------------------------------------------------------------------- failures


def _fails(
    run: Run, sequence: LoadSequence, path: str | None, kind: type[Exception], phase: str
) -> BaseException:
    with pytest.raises(kind) as info:
        sequence.run(path, run.objects())
    assert sequence.phase == phase
    assert f"stopped in its {phase} phase" in _note(info.value)
    return info.value


def test_resolve_with_nothing_committed_moves_the_counter_and_changes_nothing(
    tmp_path: Path,
) -> None:
    project = tmp_path / "run"
    (project / "checkpoints" / "checkpoint_2").mkdir(parents=True)  # an interrupted save
    run = Run(project)
    error = _fails(run, run.sequence(), None, CheckpointError, "resolve")
    assert "No committed checkpoint" in str(error) and "checkpoint_2 (incomplete)" in str(error)
    assert run.events == ["counter=3"]
    assert run.unchanged() and run.box.value == -1.0
    assert "nothing was restored" in _note(error)


def test_confine_fails_when_there_is_no_storage_for_the_path(tmp_path: Path) -> None:
    run = Run(tmp_path / "run")

    def no_storage(url: str) -> Storage:
        raise CheckpointError(f"no storage reaches {url}")

    error = _fails(
        run, run.sequence(storage_for=no_storage), "x://ckpt", CheckpointError, "confine"
    )
    assert "no storage reaches x://ckpt" in str(error)
    assert run.events == [] and run.unchanged()


def test_check_refuses_a_missing_folder_before_any_reader_opens(tmp_path: Path) -> None:
    project = tmp_path / "run"
    _saved(project)
    run = Run(project)
    missing = str(project / "checkpoints" / "checkpoint_9")
    error = _fails(run, run.sequence(), missing, CheckpointError, "check")
    assert "does not exist" in str(error)
    assert run.events == [] and run.unchanged()


def test_check_refuses_a_format_without_a_reader(tmp_path: Path) -> None:
    project = tmp_path / "run"
    folder = project / "checkpoints" / "checkpoint_0"
    _accelerate_folder(folder)
    run = Run(project)
    sequence = run.sequence(readers={COMMITTED: NativeReader})
    error = _fails(run, sequence, str(folder), CheckpointError, "check")
    assert "'accelerate' format" in str(error) and "reads committed" in str(error)
    assert run.events == [] and run.unchanged()


def test_a_damaged_file_fails_the_read_phase_and_changes_nothing(tmp_path: Path) -> None:
    project = tmp_path / "run"
    (path,), _ = _saved(project)
    weights = Path(path) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\xff\xff\xff\xff"  # same size (the check phase passes), another checksum
    weights.write_bytes(bytes(data))
    run = Run(project)
    error = _fails(run, run.sequence(), path, CorruptCheckpointError, "read")
    assert "model.safetensors" in str(error) and "checksum" in str(error)
    assert run.events == ["open committed", "check", "hook 1", "read"]  # never applied
    assert run.unchanged() and run.box.value == -1.0


def test_a_damaged_accelerate_pickle_fails_the_read_phase_and_changes_nothing(
    tmp_path: Path,
) -> None:
    project = tmp_path / "run"
    folder = project / "checkpoints" / "checkpoint_0"
    _accelerate_folder(folder)
    (folder / "optimizer.bin").write_bytes(b"not a torch.save archive")
    run = Run(project)
    error = _fails(run, run.sequence(), str(folder), CorruptCheckpointError, "read")
    assert "optimizer.bin" in str(error)
    assert run.events == ["open accelerate", "check", "hook 1", "read"]
    assert run.unchanged() and run.box.value == -1.0


def test_objects_that_do_not_fit_fail_the_read_phase_on_both_readers(tmp_path: Path) -> None:
    project = tmp_path / "run"
    (path,), _ = _saved(project)
    folder = project / "checkpoints" / "checkpoint_1"
    _accelerate_folder(folder)
    for source in (path, str(folder)):
        run = Run(project)
        objects = TrainingObjects(models=[run.model], optimizers=[run.optimizer], custom=[])
        sequence = run.sequence()
        with pytest.raises(CheckpointMismatchError, match="register_for_checkpointing"):
            sequence.run(source, objects)
        assert sequence.phase == "read"
        assert run.unchanged()


def test_a_failing_load_pre_hook_stops_the_read_phase(tmp_path: Path) -> None:
    project = tmp_path / "run"
    (path,), _ = _saved(project)
    run = Run(project)
    sequence = run.sequence()

    def hook(models: list[nn.Module], path: str) -> None:
        raise RuntimeError("the hook failed")

    sequence.hooks.append(hook)
    _fails(run, sequence, path, RuntimeError, "read")
    assert run.unchanged()


def test_a_refused_state_fails_the_apply_phase_and_says_so(tmp_path: Path) -> None:
    project = tmp_path / "run"
    (path,), _ = _saved(project)
    run = Run(project, box=Box(-1.0, refuse=True))
    error = _fails(run, run.sequence(), path, CheckpointMismatchError, "apply")
    assert "this Box refuses every state" in str(error)
    assert "may be partly restored" in _note(error)
    assert "counter=1" not in run.events  # the counter moves only after a complete apply


def test_lost_processes_fail_the_meet_phase_after_the_restore(tmp_path: Path) -> None:
    project = tmp_path / "run"
    (path,), saved = _saved(project)
    run = Run(project)
    error = _fails(run, run.sequence(lost=True), path, RuntimeError, "meet")
    assert "restored" in _note(error)
    assert run.events[-1] == "counter=1"
    assert all(torch.equal(run.model.state_dict()[k], v) for k, v in saved.items())


# --------------------------------------------------------------------------- the listener


class Failing:
    """A listener whose every method fails."""

    def checkpoint_record(self) -> Mapping[str, Any]:
        raise RuntimeError("record failed")

    def checkpoint_committed(self, report: CommitReport) -> None:
        raise RuntimeError("committed failed")

    def checkpoint_loaded(self, report: LoadReport) -> None:
        raise RuntimeError("loaded failed")


def test_a_failing_listener_is_logged_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    listener = SafeListener(Failing())
    manifest = Manifest(iteration=0, step=0, world_size=1, files=[])
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.listener"):
        assert listener.checkpoint_record() == {}
        listener.checkpoint_committed(CommitReport("c", manifest, 1.0, 1.0, False))
        listener.checkpoint_loaded(LoadReport("c", manifest, 1.0))
    for method in ("checkpoint_record", "checkpoint_committed", "checkpoint_loaded"):
        assert f"Checkpoint listener {method} failed" in caplog.text
    assert "loaded failed" in caplog.text  # with the traceback


def test_save_and_load_go_on_past_a_failing_listener(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    accelerator.prepare(nn.Linear(3, 2))
    accelerator._checkpoints.listener = Failing()
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.listener"):
        path = accelerator.save_state()
        assert accelerator.load_state() == path
    assert "checkpoint_committed failed" in caplog.text
    assert "checkpoint_loaded failed" in caplog.text
