"""Experiment continuity of the file trackers (TensorBoard, jsonl): kill -9, resume, read back.

A job (``tests/trackers/resume_job.py``) logs ``loss = step + 1000 * attempt`` every step, saves
at step 100, is killed at 150 after flushing, and resumes from the checkpoint. TensorBoard's own
``EventAccumulator`` and the jsonl file must then show each step 0..199 exactly once, the
resumed attempt's values after step 100, the checkpoint events at step 100, and the manifest
must name both runs. The in-process tests cover what a job cannot show cheaply: crafted
references, a crash in the middle of the jsonl rewrite, rows without a step, a torn last line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest

from accelkit.trackers.backends.jsonl import JSONLTracker, read_jsonl
from accelkit.trackers.backends.tensorboard import TensorBoardTracker
from accelkit.trackers.events import CheckpointEvent
from tests.helpers.distributed import free_port
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import run_job
from tests.trackers.readers import read_tensorboard

JOB = "tests.trackers.resume_job"
MOVED = "continuing in this job's"  # the warning for a reference naming another place
EXPECTED = [(step, float(step + (1000 if step > 100 else 0))) for step in range(200)]


def _job(
    jobs: Preloaded, project: Path, *args: str, processes: int = 1, killed: bool = False
) -> str:
    """Run the job, forked from ``jobs``; return its stderr (``killed``: it must die at
    --kill-at). Several processes: the fork is ``torch.distributed.run``, which starts its
    workers as fresh interpreters (sessions of their own) and watches them, as a real launch."""
    if processes == 1:
        command = ["-m", JOB]
    else:
        command = [
            "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", JOB,
        ]  # fmt: skip
    command += ["--project", str(project), "--log-with", "jsonl,tensorboard", *args]
    result = run_job(jobs, *command, timeout=240)
    output = result.stdout + result.stderr
    if killed:
        assert result.returncode != 0 and "RESULT" not in output, output[-3000:]
    else:
        assert result.returncode == 0, output[-3000:]
    return result.stderr


def _kill_at_150(jobs: Preloaded, project: Path, *args: str, processes: int = 1) -> None:
    _job(jobs, project, "--kill-at", "150", *args, processes=processes, killed=True)
    # What the resume must purge is on disk: both files hold steps 0..150 of attempt 0.
    scalars, _ = read_tensorboard(str(project), "run")
    assert [step for step, _ in scalars["loss"]] == list(range(151))
    assert [r["step"] for r in read_jsonl(str(project / "run"), metrics_only=True)] == list(
        range(151)
    )


def _resume(jobs: Preloaded, project: Path, *args: str, processes: int = 1) -> str:
    return _job(jobs, project, "--resume", "--attempt", "1", *args, processes=processes)


def _tensorboard_texts(log_dir: Path) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
        if tag.startswith("checkpoint/")
    }


def _assert_continued(project: Path) -> None:
    """Each step once with the resumed values, the events at step 100, the runs named."""
    checkpoint = str(project / "checkpoints" / "checkpoint_0")
    run = project / "run"

    # (1) TensorBoard's reader: the points after step 100 of the killed attempt are purged.
    scalars, _ = read_tensorboard(str(project), "run")
    assert scalars["loss"] == EXPECTED
    # (4) the save and the load at step 100, in their own charts, and the path as text.
    assert [step for step, _ in scalars["checkpoint/bytes"]] == [100]
    assert scalars["checkpoint/bytes"][0][1] > 0
    assert scalars["checkpoint/iteration"] == [(100, 0.0)]  # by the save only: once a step
    assert scalars["checkpoint/resumed_step"] == [(100, 100.0)]
    assert [step for step, _ in scalars["checkpoint/load_seconds"]] == [100]
    texts = _tensorboard_texts(run)
    assert texts["checkpoint/path/text_summary"] == [(100, checkpoint)]
    assert texts["checkpoint/loaded_path/text_summary"] == [(100, checkpoint)]

    # (1) jsonl: the rows after step 100 are gone, the metric rows are one per step.
    metrics = read_jsonl(str(run), metrics_only=True)
    assert [(r["step"], r["values"]["loss"]) for r in metrics] == EXPECTED
    # (4) event rows, told apart from metric rows by their "event" key.
    rows = [r for r in read_jsonl(str(run)) if "event" in r]
    assert [(r["event"], r["step"], r["path"]) for r in rows] == [
        ("checkpoint_save", 100, checkpoint),
        ("checkpoint_load", 100, checkpoint),
    ]
    assert rows[0]["values"]["checkpoint/bytes"] == scalars["checkpoint/bytes"][0][1]
    assert rows[1]["values"]["checkpoint/resumed_step"] == 100.0
    assert len(read_jsonl(str(run))) == 202
    assert not list(run.glob(".metrics.jsonl.*"))  # no temporary file left behind

    # (2) the manifest names both runs and the step they reached.
    manifest = json.loads((Path(checkpoint) / "accelkit.json").read_text())
    assert manifest["experiment"] == {
        "step": 100,
        "saved_at_step": 100,  # logged at step 100 after 101 optimizer steps: 0-based
        "key": manifest["experiment"]["key"],
        "runs": {
            "jsonl": {"path": str(run / "metrics.jsonl")},
            "tensorboard": {"log_dir": str(run)},
        },
    }


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_kill_and_resume_one_process_both_orders_moved_and_no_continue(
    tmp_path: Path, jobs: Preloaded
) -> None:
    original = tmp_path / "original"
    _kill_at_150(jobs, original)
    moved, fresh = tmp_path / "moved", tmp_path / "fresh"
    shutil.copytree(original, moved)
    shutil.copytree(original, fresh)
    before = _snapshot(original / "run")

    # (3) A copied project: its manifest names the original's files. The resume warns and
    # continues in its own folder; the original is not touched.
    stderr = _resume(jobs, moved, "--order", "load-first")
    assert stderr.count(MOVED) == 2, stderr[-3000:]  # one per tracker
    assert str(original / "run") in stderr
    _assert_continued_in_copy(moved, original)
    assert _snapshot(original / "run") == before

    # (1) In place, init_trackers before load_state (Accelerate's order): no warning.
    stderr = _resume(jobs, original, "--order", "init-first")
    assert MOVED not in stderr
    _assert_continued(original)

    # (5) --no-continue: appends as before the feature, the killed attempt's points stay.
    _resume(jobs, fresh, "--no-continue")
    duplicated = list(range(151)) + list(range(101, 200))
    scalars, _ = read_tensorboard(str(fresh), "run")
    assert [step for step, _ in scalars["loss"]] == duplicated
    metrics = read_jsonl(str(fresh / "run"), metrics_only=True)
    assert [r["step"] for r in metrics] == duplicated


def _assert_continued_in_copy(project: Path, original: Path) -> None:
    """Continued in ``project``, a copy of ``original`` made after the kill."""
    scalars, _ = read_tensorboard(str(project), "run")
    assert scalars["loss"] == EXPECTED
    metrics = read_jsonl(str(project / "run"), metrics_only=True)
    assert [(r["step"], r["values"]["loss"]) for r in metrics] == EXPECTED
    events = [(r["event"], r["path"]) for r in read_jsonl(str(project / "run")) if "event" in r]
    assert events == [  # saved by the original job, loaded by the copy
        ("checkpoint_save", str(original / "checkpoints" / "checkpoint_0")),
        ("checkpoint_load", str(project / "checkpoints" / "checkpoint_0")),
    ]


def test_kill_and_resume_two_processes_async_save(tmp_path: Path, jobs: Preloaded) -> None:
    # One launch pair (each costs ~10 s here); init-first is covered in place above.
    project = tmp_path / "project"
    _kill_at_150(jobs, project, "--async-save", processes=2)
    stderr = _resume(jobs, project, "--async-save", "--order", "load-first", processes=2)
    assert MOVED not in stderr
    _assert_continued(project)


# ---------------------------------------------------------------- jsonl, in process


def _jsonl_run(logging_dir: Path, steps: range, *, attempt: int = 0) -> JSONLTracker:
    tracker = JSONLTracker("run", str(logging_dir))
    tracker.start()
    for step in steps:
        tracker.log({"loss": float(step + 1000 * attempt)}, step=step)
    return tracker


def _save_event(step: int) -> CheckpointEvent:
    return CheckpointEvent(
        "save", step, f"/ckpt/checkpoint_{step}", step, {"checkpoint/bytes": 1.0}
    )


def test_jsonl_resume_keeps_rows_up_to_the_step_and_rows_without_one(tmp_path: Path) -> None:
    first = _jsonl_run(tmp_path, range(4))
    first.on_checkpoint(_save_event(2))
    first.log({"note": "no step"})
    first.log({"loss": 4.0}, step=4)
    first.on_checkpoint(_save_event(4))  # after the resume step: dropped with its timeline
    reference = first.run_reference()
    first.finish()
    os.chmod(first.path, 0o640)

    second = JSONLTracker("run", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reference names this very file: no warning
        second.continue_run(reference, 2)
        second.start()
    second.log({"loss": 1003.0}, step=3)
    second.finish()

    records = read_jsonl(str(tmp_path / "run"))
    assert [(r["step"], r.get("event")) for r in records] == [
        (0, None), (1, None), (2, None), (2, "checkpoint_save"), (None, None), (3, None),
    ]  # fmt: skip
    assert records[-1]["values"] == {"loss": 1003.0}
    assert records[3]["path"] == "/ckpt/checkpoint_2"
    assert [r["step"] for r in read_jsonl(str(tmp_path / "run"), metrics_only=True)] == [
        0, 1, 2, None, 3,
    ]  # fmt: skip
    assert os.stat(first.path).st_mode & 0o777 == 0o640
    assert reference == {"path": str(tmp_path / "run" / "metrics.jsonl")}


def test_jsonl_resume_reads_the_step_of_rows_written_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    rows = [
        '{"step": 1, "values": {}}',
        '{"values": {"a": 1}, "step": 9}',  # step not first: read by parsing the row
        '{"step": 2.0, "values": {}}',
        '{"step": 7.5, "values": {}}',
        '{"step": Infinity, "values": {}}',  # no finite step: kept like a row without one
        '{"step": "3", "values": {}}',
        "[1, 2]",  # not an object: not a row, moved aside
        '{"step": -4, "values": {}}',
    ]
    path.write_text("\n".join(rows) + "\n")
    tracker = JSONLTracker("run", str(tmp_path))
    tracker.continue_run(None, 2)
    with pytest.warns(UserWarning, match="line 7: '\\[1, 2\\]'"):
        tracker.start()
    tracker.finish()
    assert path.read_text().splitlines() == [rows[i] for i in (0, 2, 4, 5, 7)]
    (rejected,) = path.parent.glob("metrics.jsonl.rejected-*")
    assert rejected.read_text() == "[1, 2]\n"


def test_jsonl_drops_a_torn_last_line_with_a_warning(tmp_path: Path) -> None:
    _jsonl_run(tmp_path, range(3)).finish()
    path = tmp_path / "run" / "metrics.jsonl"
    with open(path, "a", encoding="utf-8") as file:
        file.write('{"step": 3, "timestamp": 1.0, "val')  # the crash cut this line short
    tracker = JSONLTracker("run", str(tmp_path))
    tracker.continue_run(None, 10)
    with pytest.warns(UserWarning, match="cut short"):
        tracker.start()
    tracker.log({"loss": 3.0}, step=3)
    tracker.finish()
    assert [r["step"] for r in read_jsonl(str(path))] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "reference",
    [{"path": "OTHER"}, {"path": 5}, ["not", "a", "dict"], {"path": "../../../metrics.jsonl"}],
    ids=["other-file", "not-a-string", "not-a-dict", "relative-escape"],
)
def test_jsonl_crafted_reference_redirects_nothing(tmp_path: Path, reference: Any) -> None:
    other = _jsonl_run(tmp_path / "other", range(10))
    other.finish()
    other_bytes = Path(other.path).read_bytes()
    if isinstance(reference, dict) and reference["path"] == "OTHER":
        reference = {"path": other.path}
    _jsonl_run(tmp_path / "ours", range(10)).finish()

    tracker = JSONLTracker("run", str(tmp_path / "ours"))
    with pytest.warns(UserWarning, match=MOVED) as caught:
        tracker.continue_run(reference, 4)
        tracker.start()
    assert len([w for w in caught if MOVED in str(w.message)]) == 1
    tracker.log({"loss": 1005.0}, step=5)
    tracker.finish()
    assert [r["step"] for r in read_jsonl(tracker.path)] == [0, 1, 2, 3, 4, 5]
    assert Path(other.path).read_bytes() == other_bytes


def test_jsonl_vanished_file_starts_a_new_one(tmp_path: Path) -> None:
    first = _jsonl_run(tmp_path, range(5))
    reference = first.run_reference()
    first.finish()
    os.remove(first.path)
    tracker = JSONLTracker("run", str(tmp_path))
    tracker.continue_run(reference, 3)
    tracker.start()
    tracker.log({"loss": 1004.0}, step=4)
    tracker.finish()
    assert [r["step"] for r in read_jsonl(first.path)] == [4]


def test_jsonl_failed_rewrite_leaves_the_file_as_it_was_and_keeps_logging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _jsonl_run(tmp_path, range(50)).finish()
    path = tmp_path / "run" / "metrics.jsonl"
    before = path.read_bytes()

    def disk_error(descriptor: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", disk_error)
    tracker = JSONLTracker("run", str(tmp_path))
    tracker.continue_run(None, 10)
    with pytest.warns(UserWarning, match="could not rewrite .*Input/output.* appends to it"):
        tracker.start()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]
    # The old data could not be rewritten: the new rows are still logged, after it.
    tracker.log({"loss": 1011.0}, step=11)
    tracker.finish()
    assert path.read_bytes().startswith(before)
    assert [r["step"] for r in read_jsonl(str(path))] == [*range(50), 11]


KILLED_IN_REWRITE = """
import os, signal, sys
from accelkit.trackers.backends.jsonl import JSONLTracker
# The temporary copy is complete when it is synced: die there, before the rename.
os.fsync = lambda descriptor: os.kill(os.getpid(), signal.SIGKILL)
tracker = JSONLTracker("run", sys.argv[1])
tracker.continue_run(None, 10)
tracker.start()
"""


def test_jsonl_kill_during_rewrite_loses_nothing(tmp_path: Path, jobs: Preloaded) -> None:
    _jsonl_run(tmp_path, range(50)).finish()
    path = tmp_path / "run" / "metrics.jsonl"
    before = path.read_bytes()
    result = run_job(jobs, "-c", KILLED_IN_REWRITE, str(tmp_path), timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    leftovers = list(path.parent.glob(".metrics.jsonl.*.tmp"))
    assert len(leftovers) == 1  # it died mid-rewrite ...
    assert path.read_bytes() == before  # ... and the file is whole

    tracker = JSONLTracker("run", str(tmp_path))  # the next resume cleans up and purges
    tracker.continue_run(None, 10)
    tracker.start()
    tracker.finish()
    assert [r["step"] for r in read_jsonl(str(path))] == list(range(11))
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]


# ---------------------------------------------------------------- TensorBoard, in process


def _tensorboard_run(logging_dir: Path, steps: range, *, attempt: int = 0) -> TensorBoardTracker:
    tracker = TensorBoardTracker("run", str(logging_dir))
    tracker.start()
    for step in steps:
        tracker.log({"loss": float(step + 1000 * attempt)}, step=step)
    return tracker


@pytest.mark.parametrize(
    ("reference", "warns"),
    [
        (None, False),
        ({"log_dir": "OURS"}, False),
        ({"log_dir": "OTHER"}, True),
        ({"log_dir": 3}, True),
        ("a string", True),
    ],
    ids=["none", "ours", "other-folder", "not-a-string", "not-a-dict"],
)
def test_tensorboard_resume_purges_only_its_own_folder(
    tmp_path: Path, reference: Any, warns: bool
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    other = _tensorboard_run(tmp_path / "other", range(150))
    other.finish()
    other_files = _snapshot(Path(other.log_dir))
    first = _tensorboard_run(tmp_path / "ours", range(151))
    first.log({"only_before_the_kill": 1.0}, step=120)  # no later point would hide it
    first.finish()
    if isinstance(reference, dict) and reference["log_dir"] in ("OURS", "OTHER"):
        source = first if reference["log_dir"] == "OURS" else other
        reference = source.run_reference()

    tracker = TensorBoardTracker("run", str(tmp_path / "ours"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.continue_run(reference, 100)
        tracker.start()
    assert len([w for w in caught if MOVED in str(w.message)]) == (1 if warns else 0)
    for step in range(101, 200):
        tracker.log({"loss": float(step + 1000)}, step=step)
    tracker.finish()

    events = EventAccumulator(str(tmp_path / "ours" / "run"))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert scalars["loss"] == EXPECTED
    assert scalars.get("only_before_the_kill", []) == []  # the tag is listed, its point gone
    assert _snapshot(Path(other.log_dir)) == other_files
    assert first.run_reference() == {"log_dir": str(tmp_path / "ours" / "run")}
