"""Where a job's state came from: ``experiment.resumed`` in the manifest of every checkpoint a
resumed job saves (shown by ``accelkit ckpt ls`` as RESUMED), and the ``tier`` of the trackers'
load event, kept by the tracker journal for a later delivery.

The memory tier's and the remote tier's resumes are tested beside those tiers
(``test_memory_tier.py``, ``test_replication.py``); here: the project's own checkpoints, a
folder the script named, a fresh job, and manifests crafted to break the listing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typing_extensions import override

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError, resumed_of
from accelkit.cli.main import main
from accelkit.trackers import register_tracker
from accelkit.trackers.delivery.journal import Journal
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.registry import unregister_tracker
from tests.trackers.custom import CSVTracker


def _job(project: Path, load: str | None = None, log_with: str | None = None) -> str:
    """Take one optimizer step (after loading ``load``: ``"newest"`` or a folder name) and
    save; the new checkpoint's path."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, log_with=log_with)
    if log_with:
        accelerator.init_trackers("run")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if load is not None:
        folder = None if load == "newest" else str(project / "checkpoints" / load)
        accelerator.load_state(folder)
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    path = accelerator.save_state()
    accelerator.end_training()
    return str(path)


def _manifest(path: str) -> dict[str, Any]:
    return dict(json.loads((Path(path) / "accelkit.json").read_text()))


def test_each_save_names_the_checkpoint_its_job_resumed_from(tmp_path: Path) -> None:
    project = tmp_path / "p"
    fresh = _job(project, log_with="jsonl")
    assert "resumed" not in _manifest(fresh).get("experiment", {})  # a fresh job: nothing
    newest = _job(project, load="newest", log_with="jsonl")
    named = _job(project, load="checkpoint_0")  # no trackers: recorded all the same
    assert _manifest(newest)["experiment"]["resumed"] == {
        "tier": "local",
        "checkpoint": "checkpoint_0",
        "step": 1,
    }
    assert _manifest(named)["experiment"] == {
        "resumed": {"tier": "path", "checkpoint": "checkpoint_0", "step": 1}
    }
    # The trackers' load event says the same.
    lines = (project / "run" / "metrics.jsonl").read_text().splitlines()
    loads = [json.loads(line) for line in lines if '"checkpoint_load"' in line]
    assert [(e["reason"], e["tier"]) for e in loads] == [("user", "local")]


def test_ckpt_ls_shows_where_each_saving_job_resumed_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "p"
    _job(project)
    capsys.readouterr()
    assert main(["ckpt", "ls", str(project)]) == 0
    assert "RESUMED" not in capsys.readouterr().out  # no job resumed: no column
    _job(project, load="newest")
    assert main(["ckpt", "ls", str(project), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [row["experiment"].get("resumed") for row in listed] == [
        None,
        {"tier": "local", "checkpoint": "checkpoint_0", "step": 1},
    ]
    assert main(["ckpt", "ls", str(project)]) == 0
    header, first, second = capsys.readouterr().out.splitlines()[:3]
    assert "RESUMED" in header.split()
    assert "local:checkpoint_0" in second.split() and "local:" not in first


def test_a_crafted_folder_name_stays_in_its_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A name that is valid (printable, no separator) but would fake another column.
    project = tmp_path / "p"
    path = _job(project)
    manifest = _manifest(path)
    manifest["experiment"] = {"resumed": {"tier": "memory", "checkpoint": "x  y=1", "step": 3}}
    (Path(path) / "accelkit.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["ckpt", "ls", str(project)]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "memory:x??y=1" in row.split()


@pytest.mark.parametrize(
    ("resumed", "message"),
    [
        ("local", "experiment.resumed must be an object"),
        ({"tier": "disk", "checkpoint": "c", "step": 1}, r"\.tier must be one of memory, local"),
        ({"tier": "local", "checkpoint": "", "step": 1}, r"\.checkpoint must be a folder name"),
        ({"tier": "local", "checkpoint": "x" * 256, "step": 1}, r"\.checkpoint must be"),
        ({"tier": "local", "checkpoint": "a\x1b[2Jb", "step": 1}, r"\.checkpoint must be"),
        ({"tier": "local", "checkpoint": "../c", "step": 1}, r"not a path"),
        ({"tier": "local", "checkpoint": "..", "step": 1}, r"not a path"),
        ({"tier": "local", "checkpoint": 7, "step": 1}, r"\.checkpoint must be"),
        ({"tier": "local", "checkpoint": "c", "step": -1}, r"\.step must be an integer"),
        ({"tier": "local", "checkpoint": "c", "step": True}, r"\.step must be an integer"),
        ({"tier": "local", "checkpoint": "c", "step": "3"}, r"\.step must be an integer"),
        ({"tier": "local", "checkpoint": "c", "step": 2**62}, r"\.step must be an integer"),
    ],
)
def test_a_malformed_resume_record_is_a_damaged_manifest(
    tmp_path: Path, resumed: Any, message: str
) -> None:
    manifest = _manifest(_job(tmp_path / "p"))
    manifest["experiment"] = {"resumed": resumed}
    with pytest.raises(ManifestError, match=message) as caught:
        Manifest.from_json(json.dumps(manifest), source="crafted.json")
    assert "crafted.json" in str(caught.value) and "load another checkpoint" in str(caught.value)


def test_a_resume_record_round_trips_beside_the_runs(tmp_path: Path) -> None:
    manifest = _manifest(_job(tmp_path / "p"))
    resumed = {"tier": "remote", "checkpoint": "checkpoint_4", "step": 40}
    manifest["experiment"] = {"step": 3, "runs": {"jsonl": {"run": "r"}}, "resumed": resumed}
    parsed = Manifest.from_json(json.dumps(manifest))
    assert resumed_of(parsed) == resumed
    assert parsed.experiment["runs"] == {"jsonl": {"run": "r"}}
    assert resumed_of(Manifest.from_json(parsed.to_json())) == resumed


class EventsCSV(CSVTracker):
    """The CSV tracker that also writes each checkpoint event as a JSON line."""

    name = "events_csv"

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        fields = {"step": event.step, **event.journal_fields(), "values": dict(event.values)}
        with open(Path(self.run_dir) / "events.jsonl", "a") as file:
            file.write(json.dumps(fields) + "\n")


def test_a_journaled_event_is_delivered_later_with_its_kind_reason_and_tier(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    register_tracker(EventsCSV)
    request.addfinalizer(lambda: unregister_tracker(EventsCSV.name))  # "all" must not see it
    events = [
        CheckpointEvent("replicate", 10, "s3://b/p/checkpoints/checkpoint_1", 1, {"x": 2.0}),
        CheckpointEvent("load", 12, "/shm/rank_0/snapshot_12", None, {}, "memory", "memory"),
        CheckpointEvent("save", 15, "/p/checkpoints/checkpoint_2", 2, {}, "preemption"),
    ]
    journal = Journal.open(str(tmp_path), "events_csv")
    journal.write_run({"tracker": "events_csv", "project_name": "run", "reference": None})
    journal.write(
        [journal.entry("event", e.step, dict(e.values), e.journal_fields()) for e in events]
    )
    journal.close()
    assert main(["track", "sync", str(tmp_path)]) == 0
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    sent = [json.loads(line) for line in lines]
    assert sent == [
        {"step": e.step, **e.journal_fields(), "values": dict(e.values)} for e in events
    ]


def test_an_event_with_damaged_fields_is_still_delivered_with_defaults() -> None:
    fields = {"kind": "explode", "path": 5, "iteration": "3", "reason": None, "tier": ["x"]}
    event = CheckpointEvent.from_journal(7, {"a": 1.5, "b": True, "c": "no"}, fields)
    assert event == CheckpointEvent("save", 7, "5", None, {"a": 1.5}, "user", None)
