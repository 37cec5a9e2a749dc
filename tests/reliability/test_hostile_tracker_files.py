"""Hostile tracker files (issue #23, item 4): what sits in a run folder is never followed, a
damaged ``metrics.jsonl`` never costs a job its new rows, crafted continuity values are printed
short, and a TensorBoard file from a clock that ran ahead never brings abandoned points back.

The jobs are real: ``tests/trackers/resume_job.py`` run as a process of its own (jsonl and
TensorBoard, ``loss = step + 1000 * attempt`` at every step, a checkpoint at step 10; forked
from one that imported torch once, ``tests.helpers.preloaded``, but for the clock-ahead one,
started plain), the first attempt's project copied for each scenario, then a fresh or a
resumed job on the planted or damaged project; what the trackers wrote is read back with
``read_jsonl`` and TensorBoard's own ``EventAccumulator``. The neighbours (other special
files, other files of the run folder, the reader) run in process on real files.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from accelkit._text import short
from accelkit.trackers.backends._files import TrackerFileError
from accelkit.trackers.backends.jsonl import JSONLTracker, read_jsonl
from accelkit.trackers.backends.tensorboard import TensorBoardTracker
from tests.helpers.preloaded import JOB_MODULES, Preloaded
from tests.trackers.readers import read_tensorboard

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
JOB = "tests.trackers.resume_job"
FIRST_STEPS = 15  # the first attempt logs 0..14 and saves at step 10
STEPS = 20
RESUMED = [(step, float(step + (1000 if step > 10 else 0))) for step in range(STEPS)]
# A SummaryWriter on a clock this far ahead names its file after every file written today.
AHEAD_S = 10 * 365 * 24 * 3600
SHIFTED_CLOCK = (
    "import runpy, sys, time\n"
    "real = time.time\n"
    f"time.time = lambda: real() + {AHEAD_S}\n"
    f"runpy.run_module({JOB!r}, run_name='__main__')\n"
)


ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
    "ACCELKIT_USE_CPU": "1",
    "ACCELKIT_TRACKER_TIMEOUT": "30",
}


@pytest.fixture(scope="module")
def python() -> Iterator[Preloaded]:
    """Fresh job processes, forked from one that imported torch, TensorBoard and accelkit once."""
    with Preloaded(list(JOB_MODULES), env=ENV, cwd=ROOT) as preloaded:
        yield preloaded


def _job(
    python: Preloaded, project: Path, *args: str, clock_ahead: bool = False, timeout: int = 240
) -> str:
    """Run one attempt of the job on ``project``; it must finish; return its stderr."""
    argv = ["--project", str(project), "--log-with", "jsonl,tensorboard", "--save-every", "10"]
    if clock_ahead:
        # A plain process: its clock is moved before anything is imported, so every module
        # (``from time import time`` included) reads the shifted one.
        done = subprocess.run(
            [sys.executable, "-c", SHIFTED_CLOCK, *argv, *args],
            cwd=ROOT, env=ENV, capture_output=True, timeout=timeout,
        )  # fmt: skip
    else:
        done = python.run("-m", JOB, *argv, *args, timeout=timeout)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, (stdout + stderr)[-4000:]
    assert "RESULT" in stdout
    return stderr


def _resume(python: Preloaded, project: Path) -> str:
    return _job(python, project, "--steps", str(STEPS), "--resume", "--attempt", "1")


def _metrics(project: Path, **kwargs: str) -> list[tuple[int, float]]:
    rows = read_jsonl(str(project / "run"), metrics_only=True, **kwargs)  # type: ignore[arg-type]
    return [(row["step"], row["values"]["loss"]) for row in rows]


def _reports(stderr: str, tracker: str) -> list[str]:
    return [line for line in stderr.splitlines() if f"Tracker {tracker!r} failed" in line]


@pytest.fixture(scope="module")
def first_attempt(python: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project after a first attempt: steps 0..14 logged, ``checkpoint_0`` at step 10."""
    project = tmp_path_factory.mktemp("first") / "project"
    _job(python, project, "--steps", str(FIRST_STEPS))
    assert [step for step, _ in _metrics(project)] == list(range(FIRST_STEPS))
    return project


@pytest.fixture
def project(first_attempt: Path, tmp_path: Path) -> Path:
    """A copy of the first attempt's project, to damage."""
    copy = tmp_path / "project"
    shutil.copytree(first_attempt, copy, symlinks=True)
    return copy


# ------------------------------------------------------------ files that are not regular files


def test_linked_metrics_jsonl_in_a_fresh_job_is_refused_not_appended_through(
    python: Preloaded,
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "project" / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").symlink_to(victim)

    stderr = _job(python, tmp_path / "project", "--steps", str(STEPS))
    assert victim.read_text() == "precious\n"
    assert (run / "metrics.jsonl").is_symlink()
    (report,) = _reports(stderr, "jsonl")
    assert "TrackerFileError" in report and "is a symbolic link to" in report
    assert str(run / "metrics.jsonl") in report and "Remove or rename it" in report
    # The other tracker and the training run are not affected.
    scalars, _ = read_tensorboard(str(tmp_path / "project"), "run")
    assert [step for step, _ in scalars["loss"]] == list(range(STEPS))


def test_linked_metrics_jsonl_and_temporary_in_a_resumed_job(
    python: Preloaded, project: Path, tmp_path: Path
) -> None:
    # The resume's rewrite reads the file and replaces it: neither the rows outside nor the
    # file a planted temporary name points at may be read, changed or deleted.
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.jsonl"
    run = project / "run"
    shutil.move(run / "metrics.jsonl", victim)
    (run / "metrics.jsonl").symlink_to(victim)
    other = outside / "other.txt"
    other.write_text("keep me\n")
    (run / ".metrics.jsonl.planted.tmp").symlink_to(other)
    before = victim.read_bytes()

    stderr = _resume(python, project)
    assert victim.read_bytes() == before
    assert other.read_text() == "keep me\n"
    assert not (run / ".metrics.jsonl.planted.tmp").exists()  # the link went, not its target
    (report,) = _reports(stderr, "jsonl")
    assert "is a symbolic link to" in report
    scalars, _ = read_tensorboard(str(project), "run")
    assert scalars["loss"] == RESUMED


def test_named_pipe_as_metrics_jsonl_does_not_block_the_job(
    python: Preloaded, tmp_path: Path
) -> None:
    run = tmp_path / "project" / "run"
    run.mkdir(parents=True)
    os.mkfifo(run / "metrics.jsonl")
    stderr = _job(python, tmp_path / "project", "--steps", "5", timeout=120)
    (report,) = _reports(stderr, "jsonl")
    assert "is a named pipe (FIFO), not a regular file" in report
    assert stat.S_ISFIFO(os.lstat(run / "metrics.jsonl").st_mode)


def _special(path: Path, kind: str, outside: Path) -> None:
    if kind == "folder":
        path.mkdir()
    elif kind == "link":
        path.symlink_to(outside / "victim.txt")
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
        except PermissionError:
            pytest.skip("creating a device node is not allowed here")


@pytest.mark.parametrize("kind", ["folder", "link", "device"])
@pytest.mark.parametrize(
    ("tracker", "name"),
    [("jsonl", "metrics.jsonl"), ("jsonl", "config.json"), ("tensorboard", "config.json")],
)
def test_special_files_where_tracker_files_go(
    tmp_path: Path, kind: str, tracker: str, name: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("precious\n")
    run = tmp_path / "logs" / "run"
    run.mkdir(parents=True)
    _special(run / name, kind, outside)
    made = (JSONLTracker if tracker == "jsonl" else TensorBoardTracker)(
        "run", str(tmp_path / "logs")
    )
    with pytest.raises(TrackerFileError) as refused:
        made.start()
        made.store_init_configuration({"lr": 0.1})
    made.finish()
    message = str(refused.value)
    what = {"folder": "a folder", "link": "a symbolic link to", "device": "a character device"}
    assert str(run / name) in message and what[kind] in message, message
    assert (outside / "victim.txt").read_text() == "precious\n"


@pytest.mark.parametrize("tracker", [JSONLTracker, TensorBoardTracker])
def test_linked_run_folder_is_refused(tmp_path: Path, tracker: type) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run").symlink_to(outside)
    made = tracker("run", str(tmp_path / "logs"))
    with pytest.raises(TrackerFileError, match=r"run' is a symbolic link to .* not a folder"):
        made.start()
    made.finish()
    assert list(outside.iterdir()) == []
    # The logging directory itself is the user's choice: a link there is followed.
    (tmp_path / "linked-logs").symlink_to(outside, target_is_directory=True)
    made = tracker("run", str(tmp_path / "linked-logs"))
    made.start()
    made.finish()
    assert (outside / "run").is_dir() and not (outside / "run").is_symlink()


def test_planted_side_file_names_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "values": {}}\n[1]\n')
    now = time.time()
    for second in range(-2, 120):  # every name a repair could pick in the next two minutes
        name = time.strftime("%Y%m%d-%H%M%S", time.localtime(now + second))
        (run / f"metrics.jsonl.rejected-{name}").symlink_to(victim)
    tracker = JSONLTracker("run", str(tmp_path))
    tracker.continue_run(None, 5)
    with pytest.warns(UserWarning, match=r"moved to .*rejected-\d{8}-\d{6}-1"):
        tracker.start()
    tracker.finish()
    assert victim.read_text() == "precious\n"
    (side,) = [p for p in run.iterdir() if p.name.endswith("-1")]
    assert side.read_text() == "[1]\n" and not side.is_symlink()


def test_read_jsonl_refuses_a_pipe_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "metrics.jsonl")
    code = (
        "import sys\nfrom accelkit.trackers.backends.jsonl import read_jsonl\n"
        "try:\n    read_jsonl(sys.argv[1])\nexcept OSError as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert "is a named pipe (FIFO)" in result.stdout, result.stdout + result.stderr


# ------------------------------------------------------------ damaged metrics.jsonl


JUNK = [
    b'{"step": 1' + b"0" * 5000 + b', "timestamp": 1.0, "values": {"loss": 5.0}}\n',
    b"[1, 2, 3]\n",
    b"NaN\n",
    b'{"step": 3, "values": {"text": "\xff\xfe"}}\n',  # not UTF-8
    b"[" * 100_000 + b"]" * 100_000 + b"\n",
    b'{"step": 12, "timestamp": 1.0, "val{"step": 13, "timestamp": 1.0, "values": {}}\n',
]


def test_junk_rows_never_cost_a_resumed_job_its_new_rows(python: Preloaded, project: Path) -> None:
    path = project / "run" / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    # Junk among the rows before the checkpoint and among those the resume drops.
    path.write_bytes(b"".join(lines[:3] + JUNK[:3] + lines[3:12] + JUNK[3:] + lines[12:]))

    stderr = _resume(python, project)
    assert _reports(stderr, "jsonl") == [], stderr[-3000:]
    assert _metrics(project, errors="raise") == RESUMED  # 0..10 kept, 11..19 new, file clean
    (side,) = path.parent.glob("metrics.jsonl.rejected-*")
    assert side.read_bytes() == b"".join(JUNK)
    assert stderr.count("line(s) of") == 1 and f"{len(JUNK)} line(s) of {path}" in stderr
    assert len(stderr) < 20_000  # the 200 KB of junk is not printed


def test_torn_last_line_is_repaired_and_never_glued_to_the_next_job(
    python: Preloaded, project: Path
) -> None:
    path = project / "run" / "metrics.jsonl"
    with open(path, "ab") as file:
        file.write(b'{"step": 15, "timestamp": 1.0, "val')  # a crash cut this row short
    # A fresh job (no resume) appends its rows to the run's file.
    stderr = _job(python, project, "--steps", "3", "--attempt", "1")
    assert stderr.count("cut short") == 1, stderr[-3000:]
    rows = _metrics(project, errors="raise")
    assert rows == [(s, float(s)) for s in range(FIRST_STEPS)] + [(s, 1000.0 + s) for s in range(3)]
    (side,) = path.parent.glob("metrics.jsonl.rejected-*")
    assert side.read_bytes() == b'{"step": 15, "timestamp": 1.0, "val\n'


def test_torn_line_that_cannot_be_moved_aside_is_still_never_glued(tmp_path: Path) -> None:
    # Every side-file name of the next seconds is taken, so the repair cannot run: the start
    # says so, keeps the tracker and ends the torn line before appending.
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "values": {"loss": 1.0}}\n{"step": 1, "val')
    now = time.time()
    for second in range(-1, 4):
        base = (
            f"metrics.jsonl.rejected-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now + second))}"
        )
        for name in [base, *(f"{base}-{n}" for n in range(1, 1000))]:
            (run / name).mkdir()
    tracker = JSONLTracker("run", str(tmp_path))
    with pytest.warns(UserWarning, match="could not rewrite .* all taken.* appends to it"):
        tracker.start()
    tracker.log({"loss": 2.0}, step=1)
    tracker.finish()
    assert b'{"step": 1, "val\n{"step": 1, "timestamp": ' in path.read_bytes()
    with pytest.warns(UserWarning, match=r"1 line\(s\) of .* skipped \(line 2\)"):
        rows = read_jsonl(str(path))
    assert [row["values"]["loss"] for row in rows] == [1.0, 2.0]


def test_read_jsonl_reports_skips_or_raises_on_bad_lines(tmp_path: Path) -> None:
    # A file glued by an older version: the torn row and the next job's first row on one line.
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step": 0, "values": {"loss": 1.0}}\n'
        b'{"step": 1, "timestamp": 1.0, "val{"step": 0, "values": {"loss": 2.0}}\n'
        b"5\n\n" + JUNK[0] + JUNK[3] + b'{"step": 1, "values": {"loss": 3.0}}\n'
    )
    with pytest.warns(UserWarning, match=r"4 line\(s\) of .* skipped \(line 2, 3, 5, 6\)"):
        rows = read_jsonl(str(path))
    assert [row["values"]["loss"] for row in rows] == [1.0, 3.0]
    assert read_jsonl(str(path), errors="skip") == rows
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON object row"):
        read_jsonl(str(path), errors="raise")


# ------------------------------------------------------------ crafted continuity values


def test_crafted_five_megabyte_references_are_printed_short(
    python: Preloaded, project: Path
) -> None:
    manifest_path = project / "checkpoints" / "checkpoint_0" / "accelkit.json"
    manifest = json.loads(manifest_path.read_text())
    # 5 MB: control characters, then 2.5 million path parts (realpath's cost is quadratic in them).
    crafted = "/\x1b[2J\x1b[31m/" + "a/" * 2_500_000 + "\n[fake] all good\u202e"
    manifest["experiment"]["runs"] = {
        "jsonl": {"path": crafted},
        "tensorboard": {"log_dir": crafted},
    }
    manifest_path.write_text(json.dumps(manifest))

    stderr = _resume(python, project)
    assert len(stderr.encode()) < 10_000, len(stderr)
    assert "\x1b" not in stderr and "\u202e" not in stderr and "[fake]" not in stderr
    assert stderr.count("continuing in this job's") == 2  # one warning per tracker, cut short
    assert _metrics(project, errors="raise") == RESUMED


@pytest.mark.parametrize(
    "recorded",
    ["run\x00/metrics.jsonl", "/a" * 2_500_000, 10**4000, [[[[[]]]]]],
    ids=["nul", "millions-of-parts", "4000-digit-int", "nested"],
)
@pytest.mark.parametrize(
    ("tracker", "key"), [(JSONLTracker, "path"), (TensorBoardTracker, "log_dir")]
)
def test_crafted_reference_values_cost_nothing_and_drop_nothing(
    tmp_path: Path, tracker: type, key: str, recorded: object
) -> None:
    made = tracker("run", str(tmp_path))
    started = time.perf_counter()
    with pytest.warns(UserWarning, match="continuing in this job's") as said:
        made.continue_run({key: recorded}, 3)
    assert time.perf_counter() - started < 1.0
    assert len(str(said[0].message)) < 600 and "\x00" not in str(said[0].message)
    made.start()
    made.log({"loss": 4.0}, step=4)
    made.finish()


def test_short_is_bounded_for_values_repr_cannot_print() -> None:
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    huge = 10**5000  # repr() raises ValueError past 4,300 digits
    started = time.perf_counter()
    texts = [short(value) for value in ("x" * 5_000_000, huge, deep, {"k\n": "\x1b" * 10**6})]
    assert time.perf_counter() - started < 1.0
    assert all(len(text) <= 80 and text.isprintable() for text in texts), texts
    assert texts[1] == "<int of about 5000 digits>"
    assert short("abc") == "'abc'" and short([1, (2,), {"a": None}]) == "[1, (2,), {'a': None}]"


# ------------------------------------------------------------ TensorBoard and the clock


def test_event_file_from_a_clock_ahead_does_not_bring_abandoned_points_back(
    python: Preloaded,
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    _job(python, project, "--steps", str(FIRST_STEPS), clock_ahead=True)
    (ahead,) = [p.name for p in (project / "run").iterdir() if "tfevents" in p.name]
    assert int(ahead.split(".")[3]) > time.time() + AHEAD_S / 2  # named from the future

    stderr = _resume(python, project)
    scalars, _ = read_tensorboard(str(project), "run")
    assert scalars["loss"] == RESUMED  # 11..14 of the abandoned attempt are purged
    assert [step for step, _ in scalars["checkpoint/bytes"]] == [10]
    assert stderr.count("named after this second") == 1
    names = sorted(p.name for p in (project / "run").iterdir() if "tfevents" in p.name)
    assert len(names) == 2 and ahead in names[0] and ".~" in names[0]  # renamed, not deleted
    assert _metrics(project) == RESUMED


def _losses(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _tensorboard_attempt(logging_dir: Path, steps: range, attempt: int, resume: int | None) -> None:
    tracker = TensorBoardTracker("run", str(logging_dir))
    if resume is not None:
        tracker.continue_run({"log_dir": str(logging_dir / "run")}, resume)
    tracker.start()
    for step in steps:
        tracker.log({"loss": float(step + 1000 * attempt)}, step=step)
    tracker.finish()


def _to_the_future(folder: Path) -> list[str]:
    """Rename the event files as SummaryWriters on clocks 5, 10, ... years ahead name them."""
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith("events.out.tfevents."))
    renamed = []
    for years, name in enumerate(names, start=1):
        parts = name.split(".")
        parts[3] = f"{int(parts[3]) + 5 * years * 365 * 24 * 3600:010d}"
        os.rename(folder / name, folder / ".".join(parts))
        renamed.append(".".join(parts))
    return renamed


def test_several_event_files_ahead_keep_their_order(tmp_path: Path) -> None:
    # Attempt 0 (steps 0..30) and attempt 1 (resumed at 10, steps 11..25), then both files
    # named as on clocks ahead (attempt 1's further ahead). Attempt 2 resumes at step 20:
    # 0..10 of attempt 0, 11..20 of attempt 1, 21..29 of attempt 2.
    run = tmp_path / "run"
    _tensorboard_attempt(tmp_path, range(31), 0, None)
    _tensorboard_attempt(tmp_path, range(11, 26), 1, 10)
    assert len(_to_the_future(run)) == 2
    with pytest.warns(UserWarning, match="2 event file"):
        _tensorboard_attempt(tmp_path, range(21, 30), 2, 20)
    scalars = _losses(run)
    expected = [(s, float(s + (0 if s <= 10 else 1000 if s <= 20 else 2000))) for s in range(30)]
    assert scalars["loss"] == expected

    # A file that is no writer's but holds "tfevents" and sorts last (TensorBoard reads it),
    # with a point after the next resume's step; then that resume, on the renamed files.
    stray = TensorBoardTracker("stray", str(tmp_path))
    stray.start()
    stray.log({"other": 1.0}, step=26)
    stray.finish()
    (written,) = (tmp_path / "stray").iterdir()
    os.rename(written, run / "zz.tfevents.stray")
    with pytest.warns(UserWarning, match="1 event file"):
        _tensorboard_attempt(tmp_path, range(25, 28), 3, 24)
    scalars = _losses(run)
    assert scalars["loss"] == [*expected[:25], (25, 3025.0), (26, 3026.0), (27, 3027.0)]
    assert scalars.get("other", []) == []  # read before the purge at 25: purged
    assert len([p for p in run.iterdir() if "tfevents" in p.name]) == 5  # nothing deleted
