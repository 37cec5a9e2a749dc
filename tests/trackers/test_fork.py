"""Forks, backend-independent: ``load_state(path, fork=True)`` and the copies ``accelkit ckpt
fork`` makes open new tracker runs linked to the checkpoint's, leave its runs alone, and record
the line of descent in every checkpoint the forked job (and a job resumed from it) saves.

The real backends' links (W&B ``fork_from``, MLflow's parent run, the ``forked_from`` config
entry of jsonl, TensorBoard and Comet) are tested in ``test_fork_backends.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError
from accelkit.cli.main import main
from accelkit.errors import UsageError
from tests.trackers.test_continuity_core import RunTracker


class ForkTracker(RunTracker):
    """A :class:`RunTracker` that records ``fork_run`` and its configuration."""

    name = "runs"

    def fork_run(self, reference: dict[str, Any] | None, step: int) -> None:
        self._note("fork_run", reference, step)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._note("config", values)

    def config(self) -> dict[str, Any]:
        """The configuration of the run open last (one given up at a load stored its own)."""
        return dict([call[1] for call in self.calls if call[0] == "config"][-1])

    def logged(self) -> list[tuple[int, dict[str, Any]]]:
        return [(call[1], call[2]) for call in self.calls if call[0] == "log"]


def _job(
    project: Path,
    tracker: ForkTracker | None,
    *,
    load: str | None = None,
    fork: bool = False,
    steps: int = 3,
) -> Accelerator:
    """Log ``steps`` steps (after what a load restored) and save once; the model's weights
    are set from the step so that a load is seen in them."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with=[] if tracker is None else [tracker], project_config=config)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    if tracker is not None:
        accelerator.init_trackers("run", config={"lr": 0.1})
    if load is not None:
        accelerator.load_state(None if load == "newest" else load, fork=fork)
    for _ in range(steps):
        accelerator.log({"x": 1.0})
    with torch.no_grad():
        model.weight.add_(1.0)
    accelerator.save_state()
    accelerator.end_training()
    return accelerator


def _manifest(project: Path, n: int) -> dict[str, Any]:
    path = project / "checkpoints" / f"checkpoint_{n}" / "accelkit.json"
    return dict(json.loads(path.read_text()))


def test_a_fork_opens_a_new_run_linked_to_the_checkpoints(tmp_path: Path) -> None:
    parent = ForkTracker("parent")
    _job(tmp_path / "a", parent)
    record = _manifest(tmp_path / "a", 0)["experiment"]
    before = (tmp_path / "a" / "checkpoints" / "checkpoint_0" / "accelkit.json").read_bytes()

    child = ForkTracker("child")
    source = str(tmp_path / "a" / "checkpoints" / "checkpoint_0")
    _job(tmp_path / "b", child, load=source, fork=True)

    kinds = child.kinds()
    # The run init started was given up, then a new one forked: never continued.
    assert "continue_run" not in kinds
    assert kinds[kinds.index("fork_run") + 1] == "start"
    assert ("fork_run", {"run": "parent"}, 2) in child.calls
    assert child.run_id == "child"
    # The steps go on after the checkpoint's last logged step.
    assert [step for step, _ in child.logged()] == [3, 4, 5]
    [load] = [e for e in child.events() if e.kind == "load"]
    assert load.step == 2 and load.path == source
    # The configuration records the parent.
    forked_from = child.config()["forked_from"]
    assert forked_from == {
        "checkpoint": os.path.abspath(source),
        "iteration": 0,
        "step": 2,
        "key": record["key"],
        "runs": {"runs": {"run": "parent"}},
    }
    assert child.config()["lr"] == 0.1
    # The child's checkpoints carry the lineage; its run key is the new line's.
    child_record = _manifest(tmp_path / "b", 1)["experiment"]
    assert child_record["lineage"] == {"id": child_record["key"], "parent": forked_from}
    assert child_record["key"] != record["key"]
    assert child_record["runs"] == {"runs": {"run": "child"}}
    # The parent's checkpoint and its tracker are untouched.
    assert (
        tmp_path / "a" / "checkpoints" / "checkpoint_0" / "accelkit.json"
    ).read_bytes() == before
    assert parent.kinds().count("start") == 1


def test_a_job_resumed_from_a_fork_continues_the_forked_run_and_its_lineage(
    tmp_path: Path,
) -> None:
    _job(tmp_path / "a", ForkTracker("parent"))
    _job(
        tmp_path / "b",
        ForkTracker("child"),
        load=str(tmp_path / "a/checkpoints/checkpoint_0"),
        fork=True,
    )
    lineage = _manifest(tmp_path / "b", 1)["experiment"]["lineage"]

    resumed = ForkTracker("resumed")
    _job(tmp_path / "b", resumed, load="newest")
    assert "fork_run" not in resumed.kinds()
    assert ("continue_run", {"run": "child"}, 5) in resumed.calls
    assert resumed.run_id == "child"
    # The configuration stored again still says where the run came from.
    assert resumed.config()["forked_from"] == lineage["parent"]
    assert _manifest(tmp_path / "b", 2)["experiment"]["lineage"] == lineage


def test_a_fork_of_a_fork_names_its_parents_line(tmp_path: Path) -> None:
    _job(tmp_path / "a", ForkTracker("a"))
    _job(
        tmp_path / "b",
        ForkTracker("b"),
        load=str(tmp_path / "a/checkpoints/checkpoint_0"),
        fork=True,
    )
    _job(
        tmp_path / "c",
        ForkTracker("c"),
        load=str(tmp_path / "b/checkpoints/checkpoint_1"),
        fork=True,
    )
    b_line = _manifest(tmp_path / "b", 1)["experiment"]["lineage"]["id"]
    c_lineage = _manifest(tmp_path / "c", 2)["experiment"]["lineage"]
    assert c_lineage["parent"]["id"] == b_line
    assert c_lineage["id"] not in (b_line, None)


def test_fork_after_logging_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    _job(tmp_path / "a", ForkTracker("parent"))
    config = ProjectConfiguration(project_dir=str(tmp_path / "b"))
    tracker = ForkTracker("late")
    accelerator = Accelerator(log_with=[tracker], project_config=config)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.init_trackers("run")
    accelerator.log({"x": 1.0})
    weight = model.weight.detach().clone()
    with pytest.raises(UsageError, match=r"before the\s+first accelerator.log\(\)"):
        accelerator.load_state(str(tmp_path / "a/checkpoints/checkpoint_0"), fork=True)
    assert torch.equal(model.weight, weight)  # nothing was loaded
    assert "fork_run" not in tracker.kinds()
    accelerator.end_training()


def test_a_fork_without_trackers_still_records_its_lineage(tmp_path: Path) -> None:
    _job(tmp_path / "a", None)
    source = str(tmp_path / "a/checkpoints/checkpoint_0")
    _job(tmp_path / "b", None, load=source, fork=True)
    record = _manifest(tmp_path / "b", 1)["experiment"]
    assert set(record) == {"lineage", "resumed"}
    assert record["resumed"] == {"tier": "path", "checkpoint": "checkpoint_0", "step": 0}
    assert record["lineage"]["parent"]["checkpoint"] == os.path.abspath(source)
    assert record["lineage"]["parent"]["runs"] == {}
    # A job with a tracker resuming from it opens a new run, and keeps the lineage: a record
    # without runs is no run to continue (and no step to drop rows after).
    tracker = ForkTracker("new")
    _job(tmp_path / "b", tracker, load="newest")
    assert "continue_run" not in tracker.kinds() and "fork_run" not in tracker.kinds()
    assert _manifest(tmp_path / "b", 2)["experiment"]["lineage"] == record["lineage"]


def test_a_copy_made_by_ckpt_fork_forks_at_its_first_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _job(tmp_path / "a", ForkTracker("parent"))
    parent_key = _manifest(tmp_path / "a", 0)["experiment"]["key"]
    source = str(tmp_path / "a/checkpoints/checkpoint_0")
    assert main(["ckpt", "fork", source, str(tmp_path / "b"), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)["line"]
    copy = _manifest(tmp_path / "b", 0)["experiment"]
    assert copy["lineage"]["start"] is True and copy["lineage"]["id"] == line
    assert "runs" not in copy  # the copy belongs to no run yet

    child = ForkTracker("child")
    _job(tmp_path / "b", child, load="newest")  # a plain resume
    assert ("fork_run", {"run": "parent"}, 2) in child.calls
    assert "continue_run" not in child.kinds()
    assert [step for step, _ in child.logged()] == [3, 4, 5]
    saved = _manifest(tmp_path / "b", 1)["experiment"]
    assert saved["lineage"] == {"id": line, "parent": copy["lineage"]["parent"]}
    assert saved["lineage"]["parent"]["key"] == parent_key
    assert saved["key"] == line
    # The line starts once: a job resumed from the fork's own save continues its run.
    again = ForkTracker("again")
    _job(tmp_path / "b", again, load="newest")
    assert ("continue_run", {"run": "child"}, 5) in again.calls


_PARENT = {"checkpoint": "/runs/a/checkpoints/checkpoint_0", "iteration": 0, "step": 2}


@pytest.mark.parametrize(
    ("lineage", "field"),
    [
        ("abc", "experiment.lineage must be an object"),
        ({"id": "abc"}, "experiment.lineage must be an object"),
        ({"id": "../x", "parent": _PARENT}, r"experiment.lineage.id must be a run key"),
        ({"parent": {**_PARENT, "id": 7}}, r"experiment.lineage.parent.id"),
        ({"parent": {**_PARENT, "key": "a b"}}, r"experiment.lineage.parent.key"),
        ({"parent": {**_PARENT, "checkpoint": ""}}, r"parent.checkpoint must be a path"),
        ({"parent": {**_PARENT, "checkpoint": "x" * 5000}}, r"parent.checkpoint must be a path"),
        ({"parent": {**_PARENT, "iteration": -1}}, r"parent.iteration"),
        ({"parent": {**_PARENT, "iteration": True}}, r"parent.iteration"),
        ({"parent": {**_PARENT, "step": "2"}}, r"parent.step"),
        ({"parent": {**_PARENT, "runs": {"wandb": "id"}}}, r"parent.runs"),
        ({"start": "yes", "parent": _PARENT}, r"experiment.lineage.start"),
    ],
)
def test_a_malformed_lineage_is_a_corrupt_manifest(
    tmp_path: Path, lineage: Any, field: str
) -> None:
    _job(tmp_path / "a", None)
    manifest = _manifest(tmp_path / "a", 0)
    manifest["experiment"] = {"lineage": lineage}
    with pytest.raises(ManifestError, match=field):
        Manifest.from_json(json.dumps(manifest), source="crafted.json")


def test_a_lineage_round_trips_through_the_manifest(tmp_path: Path) -> None:
    _job(tmp_path / "a", None)
    manifest = _manifest(tmp_path / "a", 0)
    lineage = {
        "id": "f" * 32,
        "parent": {**_PARENT, "key": "e" * 32, "runs": {"wandb": {"run_id": "x"}}},
    }
    manifest["experiment"] = {"lineage": lineage}
    parsed = Manifest.from_json(json.dumps(manifest))
    assert parsed.experiment == {"lineage": lineage}
    assert Manifest.from_json(parsed.to_json()).experiment == {"lineage": lineage}


def _two_process_fork(parent: str, project: str) -> dict[str, Any]:
    tracker = ForkTracker("child")
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with=[tracker], project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.init_trackers("run")
    accelerator.load_state(parent, fork=True)
    accelerator.log({"y": 1})
    logged_at = accelerator._trackers.last_step
    accelerator.save_state()
    accelerator.end_training()
    forked = [call for call in tracker.calls if call[0] == "fork_run"]
    return {"logged_at": logged_at, "forked": forked}


@pytest.mark.slow
def test_every_process_of_a_forked_job_counts_on_from_the_checkpoints_step(
    tmp_path: Path,
) -> None:
    from tests.helpers.distributed import run_distributed

    _job(tmp_path / "a", ForkTracker("parent"))
    parent = str(tmp_path / "a" / "checkpoints" / "checkpoint_0")
    main, other = run_distributed(_two_process_fork, parent, str(tmp_path / "b"), world_size=2)
    assert main["logged_at"] == other["logged_at"] == 3
    assert main["forked"] == [("fork_run", {"run": "parent"}, 2)]
    assert other["forked"] == []  # only the main process has the tracker
    lineage = _manifest(tmp_path / "b", 1)["experiment"]["lineage"]
    assert lineage["parent"]["checkpoint"] == parent


def test_a_fork_loaded_before_init_trackers_forks_the_named_trackers(tmp_path: Path) -> None:
    """The other call order, with trackers named in ``log_with`` (opened at their first use)."""
    _job(tmp_path / "a", ForkTracker("parent"))
    source = str(tmp_path / "a" / "checkpoints" / "checkpoint_0")
    config = ProjectConfiguration(project_dir=str(tmp_path / "b"), automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with=["jsonl"], project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.load_state(source, fork=True)
    accelerator.init_trackers("child", config={"lr": 0.5})
    accelerator.log({"x": 1.0})
    accelerator.save_state()
    accelerator.end_training()
    folder = tmp_path / "b" / "child"
    config_file = json.loads((folder / "config.json").read_text())
    assert config_file["lr"] == 0.5
    assert config_file["forked_from"]["checkpoint"] == source
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "event" not in row] == [3]
    record = _manifest(tmp_path / "b", 1)["experiment"]
    assert record["lineage"]["id"] == record["key"]
