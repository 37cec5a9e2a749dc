"""examples/custom_tracker.py: a registered tracker joins "all", and a failing one is isolated."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from accelkit.trackers import installed_trackers
from tests.examples.runner import launch, read_jsonl

STEPS = 5


def test_custom_tracker_joins_all_and_a_broken_tracker_is_isolated(tmp_path: Path) -> None:
    project = tmp_path / "run"
    result = launch(
        "custom_tracker.py",
        "--project_dir",
        str(project),
        "--steps",
        str(STEPS),
        "--broken",
        cwd=tmp_path,
        # The broken tracker never delivers: end_training gives up on it after 1 s of retries,
        # not the default 10 (ACCELKIT_TRACKER_DRAIN_S), which only made the job wait.
        env={"ACCELKIT_TRACKER_DRAIN_S": "1"},
    )
    # "all" = every installed built-in + the registered "csv" + the instance given.
    line = next(x for x in result.stdout.splitlines() if x.startswith("trackers:"))
    started = set(line.removeprefix("trackers:").replace(",", " ").split())
    assert started == {*installed_trackers(), "csv", "broken"}

    # The failing tracker is reported once, by name; training and the other trackers go on.
    assert result.stderr.count("Tracker 'broken' failed in log()") == 1
    # Its values wait in its journal, and the job's last words say how to send them.
    assert f"Tracker 'broken': {STEPS} journaled entries were not delivered" in result.stderr
    assert f"accelkit track sync {project} --tracker broken" in result.stderr
    with open(project / "custom_tracker" / "metrics.csv", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    # Only the main process logs: every step exactly once although 2 processes ran.
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == list(range(1, STEPS + 1))
    assert {r["name"] for r in rows} >= {"config/lr", "config/steps", "loss", "lr"}
    assert f"csv tracker wrote {STEPS} loss rows" in result.stdout
    records = read_jsonl(project / "custom_tracker" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert json.loads((project / "custom_tracker" / "config.json").read_text())["steps"] == STEPS
