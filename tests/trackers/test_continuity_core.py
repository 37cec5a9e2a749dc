"""Experiment continuity, backend-independent: what a checkpoint records of the tracker runs,
how a resumed job hands it back (either call order, every process), and checkpoint events.

The backends' own continuations are tested against the real SDKs in the other
``test_continuity_*`` files.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError
from accelkit.trackers import GeneralTracker
from accelkit.trackers.delivery.journal import journal_folders
from accelkit.trackers.events import CheckpointEvent
from tests.helpers.distributed import run_distributed


class RunTracker(GeneralTracker):
    """Records every call (and its thread); its run is ``{"run": <id>}``."""

    name = "runs"

    def __init__(self, run_id: str = "first", fail_in: str | None = None) -> None:
        super().__init__(run_name="")
        self.run_id = run_id
        self.fail_in = fail_in
        self.calls: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()
        self.started = threading.Event()

    def _note(self, *call: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.calls.append(call)
        if self.fail_in == call[0]:
            raise RuntimeError(f"{self.name} broke in {call[0]}")

    def start(self) -> None:
        self._note("start")
        self.started.set()

    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        self._note("continue_run", reference, step)
        if reference is not None:
            self.run_id = str(reference["run"])

    def run_reference(self) -> dict[str, Any] | None:
        self._note("run_reference")
        return {"run": self.run_id}

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._note("log", step, dict(values))

    def on_checkpoint(self, event: CheckpointEvent) -> None:
        self._note("on_checkpoint", event)

    def finish(self) -> None:
        self._note("finish")

    def discard_run(self) -> bool:
        self._note("discard_run", self.run_id)
        return True

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls if call[0] != "run_reference"]

    def events(self) -> list[CheckpointEvent]:
        return [call[1] for call in self.calls if call[0] == "on_checkpoint"]


def _accelerator(tmp_path: Path, tracker: GeneralTracker, **config: Any) -> Accelerator:
    project = ProjectConfiguration(
        project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True, **config
    )
    accelerator = Accelerator(log_with=[tracker], project_config=project)
    accelerator.prepare(torch.nn.Linear(2, 2))
    return accelerator


def _manifest(tmp_path: Path, n: int = 0) -> dict[str, Any]:
    path = tmp_path / "project" / "checkpoints" / f"checkpoint_{n}" / "accelkit.json"
    return dict(json.loads(path.read_text()))


def _first_job(tmp_path: Path) -> RunTracker:
    tracker = RunTracker("first")
    accelerator = _accelerator(tmp_path, tracker)
    accelerator.init_trackers("run")
    for step in range(5):
        accelerator.log({"x": step}, step=step)
    accelerator.save_state()
    accelerator.log({"x": 5}, step=5)
    accelerator.end_training()
    return tracker


def test_a_checkpoint_names_its_runs_and_the_last_logged_step(tmp_path: Path) -> None:
    _first_job(tmp_path)
    record = _manifest(tmp_path)["experiment"]
    # RunTracker has no name_run (a custom tracker written before run keys): the save waited
    # for its run to open, so that the checkpoint names it.
    assert record == {
        "step": 4,
        "saved_at_step": 4,  # no optimizer: at the last logged step
        "key": record["key"],
        "runs": {"runs": {"run": "first"}},
    }
    parsed = Manifest.from_json(json.dumps(_manifest(tmp_path)))
    assert parsed.experiment["runs"]["runs"] == {"run": "first"}


@pytest.mark.parametrize("order", ["init_first", "load_first", "init_first_explicit_path"])
def test_a_resumed_job_continues_the_run_in_either_call_order(tmp_path: Path, order: str) -> None:
    _first_job(tmp_path)
    tracker = RunTracker("second")
    accelerator = _accelerator(tmp_path, tracker)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left behind: no warning
        if order.startswith("init_first"):
            accelerator.init_trackers("run")
            # An instance is started by init_trackers, as Accelerate starts it.
            assert tracker.kinds() == ["start"]
            # Accelerate's examples: load_state(args.resume_from_checkpoint), a path.
            path = tmp_path / "project" / "checkpoints" / "checkpoint_0"
            accelerator.load_state(str(path) if order.endswith("explicit_path") else None)
            # The run it opened, with nothing logged, was given up for the checkpoint's and
            # discarded; the checkpoint's run is open when load_state returns.
            assert tracker.kinds() == ["start", "finish", "discard_run", "continue_run", "start"]
            assert ("discard_run", "second") in tracker.calls
            # The given-up run's journal (its configuration only) is gone, not set aside
            # for `accelkit track sync`: one journal, the continued run's.
            [journal] = journal_folders(str(tmp_path / "project"))
            run = json.loads((Path(journal) / "run.json").read_text())
            assert run["reference"] == {"run": "first"}
        else:
            accelerator.load_state()
            accelerator.init_trackers("run")
            assert tracker.kinds()[:2] == ["continue_run", "start"]
        accelerator.log({"y": 1})  # no step: continues after the checkpoint's step
        accelerator.end_training()
    assert tracker.kinds().count("start") == (2 if order.startswith("init_first") else 1)
    assert ("continue_run", {"run": "first"}, 4) in tracker.calls
    assert tracker.run_id == "first"
    assert ("log", 5, {"y": 1}) in tracker.calls
    [load] = tracker.events()
    assert load.kind == "load" and load.step == 4
    assert load.values["checkpoint/resumed_step"] == 4.0
    assert load.path.endswith("checkpoint_0")


def test_an_instance_given_up_after_init_names_the_checkpoints_run_and_key(
    tmp_path: Path,
) -> None:
    _first_job(tmp_path)
    first_key = _manifest(tmp_path)["experiment"]["key"]

    class Keeping(RunTracker):  # a tracker that cannot delete a run (the default)
        def discard_run(self) -> bool:
            self._note("discard_run", self.run_id)
            return GeneralTracker.discard_run(self)

    tracker = Keeping("second")
    accelerator = _accelerator(tmp_path, tracker)
    accelerator.init_trackers("run")
    with pytest.warns(UserWarning, match=r"Tracker 'runs'.*\{'run': 'second'\}.*left as it is"):
        accelerator.load_state()
    accelerator.log({"y": 1})
    accelerator.save_state()
    accelerator.end_training()
    # The next checkpoint names the continued run, under the first job's run key.
    record = _manifest(tmp_path, 1)["experiment"]
    assert record["key"] == first_key
    assert record["runs"] == {"runs": {"run": "first"}}
    assert tracker.kinds().count("start") == 2


def test_a_load_in_the_middle_of_a_run_leaves_its_runs_alone(tmp_path: Path) -> None:
    # Loading the best checkpoint to evaluate it must not rewind the curves logged so far.
    tracker = RunTracker("live")
    accelerator = _accelerator(tmp_path, tracker)
    accelerator.init_trackers("run")
    accelerator.log({"x": 0}, step=0)
    accelerator.save_state()
    for step in range(1, 10):
        accelerator.log({"x": step}, step=step)
    accelerator.load_state()
    accelerator.log({"eval": 1})
    accelerator.end_training()
    assert "continue_run" not in tracker.kinds()
    assert tracker.kinds().count("start") == 1
    assert ("log", 10, {"eval": 1}) in tracker.calls


def test_the_opt_outs_start_new_runs_and_record_no_events(tmp_path: Path) -> None:
    _first_job(tmp_path)
    tracker = RunTracker("second")
    accelerator = _accelerator(
        tmp_path, tracker, continue_tracker_runs=False, checkpoint_events=False
    )
    accelerator.init_trackers("run")
    assert tracker.started.is_set()  # opened in init_trackers, as the reference does
    accelerator.load_state()
    accelerator.log({"y": 1})
    accelerator.save_state()
    accelerator.end_training()
    assert "continue_run" not in tracker.kinds()
    assert tracker.events() == []
    assert tracker.run_id == "second"
    assert ("log", 0, {"y": 1}) in tracker.calls  # the counter was not moved either
    # The runs are still recorded: ``ckpt ls`` links checkpoints to runs either way.
    assert _manifest(tmp_path, 1)["experiment"]["runs"] == {"runs": {"run": "second"}}


@pytest.mark.parametrize("async_save", [False, True])
def test_save_events_reach_the_trackers_on_their_own_thread(
    tmp_path: Path, async_save: bool
) -> None:
    tracker = RunTracker()
    accelerator = _accelerator(tmp_path, tracker, async_save=async_save)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=7)
    accelerator.save_state()
    accelerator.wait_for_checkpoints()
    accelerator.end_training()
    [save] = tracker.events()
    assert save.kind == "save" and save.step == 7 and save.iteration == 0
    assert save.path.endswith("checkpoints/checkpoint_0")
    assert save.name == "checkpoint_0"
    manifest = _manifest(tmp_path)
    assert save.values["checkpoint/bytes"] == sum(entry["size"] for entry in manifest["files"])
    assert save.values["checkpoint/iteration"] == 0.0
    seconds = save.values["checkpoint/save_seconds"]
    blocking = save.values["checkpoint/blocking_seconds"]
    assert 0 < blocking <= seconds
    if not async_save:
        assert blocking == seconds
    assert tracker.threads == {"accelkit-tracker-runs"}


def test_the_default_on_checkpoint_logs_the_numbers_at_the_saves_step(tmp_path: Path) -> None:
    class Plain(GeneralTracker):
        name = "plain"

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int | None, dict[str, Any]]] = []

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.logged.append((step, values))

    plain = Plain()
    accelerator = _accelerator(tmp_path, plain)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=3)
    accelerator.save_state()
    accelerator.end_training()
    assert plain.logged[0] == (3, {"x": 1})
    step, values = plain.logged[1]
    assert step == 3 and set(values) == {
        "checkpoint/save_seconds",
        "checkpoint/blocking_seconds",
        "checkpoint/bytes",
        "checkpoint/iteration",
    }


@pytest.mark.parametrize("method", ["run_reference", "on_checkpoint"])
def test_a_tracker_failing_at_checkpoints_never_fails_the_save(tmp_path: Path, method: str) -> None:
    tracker = RunTracker(fail_in=method)
    accelerator = _accelerator(tmp_path, tracker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.init_trackers("run")  # starts the instance (run_reference follows)
        accelerator.log({"x": 1}, step=0)
        path = accelerator.save_state()
        accelerator.log({"x": 2}, step=1)
        accelerator.end_training()
    assert Path(path, "accelkit.json").exists()
    said = [str(w.message) for w in caught if f"{method}() failed" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    # The tracker goes on logging.
    assert ("log", 1, {"x": 2}) in tracker.calls
    if method == "run_reference":
        assert _manifest(tmp_path)["experiment"]["runs"] == {}


def test_a_save_makes_no_backend_call_on_the_training_thread(tmp_path: Path) -> None:
    # What a save costs the trackers' side is measured in benchmarks/bench_trackers.py; here:
    # the references come from the worker's cache, the event is a queue append.
    tracker = RunTracker()
    accelerator = _accelerator(tmp_path, tracker)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=0)
    accelerator.get_tracker("runs")  # opened
    calls_before = len(tracker.calls)
    accelerator.save_state()
    accelerator.end_training()
    after = tracker.calls[calls_before:]
    assert [call[0] for call in after] == ["on_checkpoint", "finish"]  # finish: end_training
    assert tracker.threads == {"accelkit-tracker-runs"}


@pytest.mark.parametrize(
    ("experiment", "field"),
    [
        ({"step": True, "runs": {}}, "experiment.step"),
        ({"step": -5, "runs": {}}, "experiment.step"),
        ({"step": 10**30, "runs": {}}, "experiment.step"),
        ({"step": 3, "saved_at_step": "3", "runs": {}}, "experiment.saved_at_step"),
        ({"step": 3, "saved_at_step": -2, "runs": {}}, "experiment.saved_at_step"),
        ({"step": 3, "runs": ["wandb"]}, "experiment.runs"),
        ({"step": 3, "runs": {"wandb": "abc"}}, "experiment.runs"),
        ({"step": 3, "runs": {}, "key": "../x"}, "experiment.key"),
        ({"step": 3, "runs": {}, "key": "a" * 65}, "experiment.key"),
        ({"step": 3, "runs": {}, "key": 7}, "experiment.key"),
        ({"step": 3, "runs": {}, "pending": "wandb"}, "experiment.pending"),
    ],
)
def test_a_malformed_experiment_record_is_a_corrupt_manifest(
    tmp_path: Path, experiment: dict[str, Any], field: str
) -> None:
    _first_job(tmp_path)
    manifest = _manifest(tmp_path)
    manifest["experiment"] = experiment
    with pytest.raises(ManifestError, match=field):
        Manifest.from_json(json.dumps(manifest), source="crafted.json")


def _two_process_job(project: str, resume: bool) -> dict[str, Any]:
    tracker = RunTracker("second" if resume else "first")
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with=[tracker], project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.init_trackers("run")
    if not resume:
        for step in range(12):
            accelerator.log({"x": step}, step=step)
        accelerator.save_state()
        accelerator.end_training()
        return {}
    accelerator.load_state()
    accelerator.log({"y": 1})
    logged_at = accelerator._trackers.last_step
    accelerator.end_training()
    continued = [call for call in tracker.calls if call[0] == "continue_run"]
    return {"logged_at": logged_at, "continued": continued}


@pytest.mark.slow
def test_every_process_continues_at_the_checkpoints_step(tmp_path: Path) -> None:
    project = str(tmp_path / "project")
    run_distributed(_two_process_job, project, False, world_size=2)
    main, other = run_distributed(_two_process_job, project, True, world_size=2)
    # Every process counts on from the checkpoint's step, so they agree on the next step.
    assert main["logged_at"] == other["logged_at"] == 12
    assert main["continued"] == [("continue_run", {"run": "first"}, 11)]
    assert other["continued"] == []  # only the main process has the tracker


def _epoch_logging_job(
    project: Path, resume_from: str | None = None, epoch_axis: bool = False
) -> Accelerator:
    """A script that takes 40 optimizer steps, logs at the end of each 20-step epoch (at its
    optimizer step, or with ``step=epoch`` as Accelerate's examples do) and saves every 10
    steps, into the real jsonl tracker; resumed, it loads ``resume_from`` and logs once more."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with="jsonl", project_config=config)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume_from is not None:
        accelerator.load_state(resume_from)
    accelerator.init_trackers("run")
    if resume_from is not None:
        accelerator.log({"resumed": 1.0}, step=31)
        return accelerator
    for step in range(1, 41):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0:
            accelerator.log({"epoch_loss": float(step)}, step=step // 20 if epoch_axis else step)
        if step % 10 == 0:
            accelerator.save_state()
    return accelerator


def _rows(project: Path) -> list[dict[str, Any]]:
    from accelkit.trackers.backends.jsonl import read_jsonl

    return read_jsonl(str(project / "run"))


def test_checkpoint_events_are_at_the_saves_step(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _epoch_logging_job(project).end_training()
    saves = [row for row in _rows(project) if row.get("event") == "checkpoint_save"]
    # Each save at the optimizer step it was made (its manifest's step), not at the step of
    # the epoch's log() before it (-1, 20, 20, 40).
    assert [row["step"] for row in saves] == [10, 20, 30, 40]
    assert [row["values"]["checkpoint/iteration"] for row in saves] == [0.0, 1.0, 2.0, 3.0]
    third = project / "checkpoints" / "checkpoint_2"
    manifest = json.loads((third / "accelkit.json").read_text())
    assert manifest["step"] == 30
    assert manifest["experiment"]["step"] == 20 and manifest["experiment"]["saved_at_step"] == 30

    # Resumed from the save at step 30: the run drops what was logged after the checkpoint
    # (after step 20, the last step logged before it: its own point at 30 too), and the load
    # takes the save's place at step 30, with its iteration.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: same file, same run
        _epoch_logging_job(project, str(third)).end_training()
    rows = [(row.get("event"), row["step"]) for row in _rows(project)]
    assert rows == [
        ("checkpoint_save", 10),
        (None, 20),
        ("checkpoint_save", 20),
        ("checkpoint_load", 30),
        (None, 31),
    ]
    [load] = [row for row in _rows(project) if row.get("event") == "checkpoint_load"]
    assert load["values"]["checkpoint/iteration"] == 2.0
    assert load["values"]["checkpoint/resumed_step"] == 20.0


def test_a_script_logging_by_epoch_gets_its_checkpoints_at_its_last_logged_epoch(
    tmp_path: Path,
) -> None:
    # step=epoch (Accelerate's examples): the optimizer steps are another axis; a save is put
    # at the last logged epoch, never ahead of it.
    project = tmp_path / "project"
    _epoch_logging_job(project, epoch_axis=True).end_training()
    saves = [row["step"] for row in _rows(project) if row.get("event") == "checkpoint_save"]
    assert saves == [10, 1, 1, 2]  # before any log(): the save's own step
