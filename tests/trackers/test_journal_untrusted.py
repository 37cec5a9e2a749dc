"""What is read back from a tracker journal is untrusted input (#37 items 7a, 7b).

7a: ``accelkit track sync`` builds the tracker from ``run.json``; a copied or crafted one must
not make it write outside the logging directory the journal lives under.
7b: a segment holding a huge line without a newline is read in bounded pieces, never whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from accelkit.cli.main import main as cli
from accelkit.trackers.delivery.journal import JOURNAL_FOLDER, Journal
from tests.trackers.conftest import job_env

_ROOT = str(Path(__file__).resolve().parents[2])


def _victim(tmp_path: Path) -> Path:
    """A run folder outside the logging directory, holding 100 rows."""
    folder = tmp_path / "victim"
    folder.mkdir()
    rows = "".join(
        json.dumps({"step": step, "timestamp": 0.0, "values": {"loss": 1.0}}) + "\n"
        for step in range(100)
    )
    (folder / "metrics.jsonl").write_text(rows)
    return folder


def _craft(logs: Path, tracker: str, run: dict[str, Any], steps: int = 2) -> None:
    """A journal of ``tracker`` under ``logs`` with ``run`` as its run.json and ``steps``
    pending entries."""
    journal = Journal.open(str(logs), tracker)
    journal.write_run({"tracker": tracker, "reference": None, **run})
    journal.write([journal.entry("log", step, {"loss": 0.5}) for step in range(steps)])
    journal.close()


@pytest.mark.parametrize("where", ["dotdot", "absolute", "link"])
def test_sync_refuses_a_run_folder_outside_the_logging_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    victim = _victim(tmp_path)
    before = (victim / "metrics.jsonl").read_bytes()
    logs = tmp_path / "logs"
    logs.mkdir()
    project = {"dotdot": "../victim", "absolute": str(victim), "link": "run"}[where]
    if where == "link":
        (logs / "run").symlink_to(victim)
    _craft(
        logs,
        "jsonl",
        {"project_name": project, "reference": {"path": str(victim / "metrics.jsonl")}},
    )

    assert cli(["track", "sync", str(logs)]) == 1
    out = capsys.readouterr().out
    assert (victim / "metrics.jsonl").read_bytes() == before  # 100 rows, untouched
    assert "jsonl: nothing to send; 2 pending" in out
    assert repr(project) in out and "outside the logging directory" in out
    assert "--allow-outside" in out


def test_sync_allow_outside_writes_where_the_users_own_journal_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = _victim(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    _craft(logs, "jsonl", {"project_name": "../victim"})
    assert cli(["track", "sync", str(logs), "--allow-outside"]) == 0
    assert "jsonl: sent 2 entries (seq 0..1); 0 pending" in capsys.readouterr().out
    assert len((victim / "metrics.jsonl").read_text().splitlines()) == 102


def test_sync_inside_the_logging_directory_still_delivers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _craft(tmp_path, "jsonl", {"project_name": "nested/../run"})
    assert cli(["track", "sync", str(tmp_path)]) == 0
    assert "jsonl: sent 2 entries (seq 0..1); 0 pending" in capsys.readouterr().out
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("tracker", "kwargs"),
    [
        ("wandb", {"dir": "{elsewhere}"}),
        ("wandb", {"settings": {"root_dir": "{elsewhere}"}}),
        ("mlflow", {"tracking_uri": "sqlite:///{elsewhere}/mlflow.db"}),
        ("mlflow", {"tracking_uri": "file://{elsewhere}/mlruns"}),
        ("mlflow", {"artifact_location": "{elsewhere}/art"}),
        ("mlflow", {"logging_dir": "{elsewhere}"}),
    ],
)
def test_sync_refuses_init_kwargs_paths_outside_the_logging_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tracker: str, kwargs: dict[str, Any]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    logs = tmp_path / "logs"
    logs.mkdir()
    filled = json.loads(json.dumps(kwargs).replace("{elsewhere}", str(elsewhere)))
    _craft(logs, tracker, {"project_name": "p", "init_kwargs": filled})
    assert cli(["track", "sync", str(logs)]) == 1
    out = capsys.readouterr().out
    assert f"{tracker}: nothing to send; 2 pending" in out
    assert "outside the logging directory" in out and str(elsewhere) in out
    assert not elsewhere.exists()


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ("http://127.0.0.1:5000", False),
        ("https://api.wandb.ai", False),
        ("s3://bucket/art", False),
        ("postgresql://user@db/mlflow", False),
        ("sqlite://", False),  # in memory
        ("sqlite:///{logs}/mlflow.db", False),
        ("file://{logs}/mlruns", False),
        ("{logs}/wandb", False),
        ("sqlite:////etc/mlflow.db", True),
        ("file:///etc/mlruns", True),
        ("{logs}/../x", True),
        ("/etc", True),
    ],
)
def test_network_addresses_pass_and_local_paths_must_stay_inside(
    tmp_path: Path, value: str, refused: bool
) -> None:
    from accelkit.trackers.backends._files import TrackerFileError
    from accelkit.trackers.delivery.sync import check_run_paths
    from accelkit.trackers.registry import get_tracker_class

    value = value.replace("{logs}", str(tmp_path))
    run = {"project_name": "p", "init_kwargs": {"settings": {"base_url": "x", "root_dir": value}}}
    if refused:
        with pytest.raises(TrackerFileError, match="outside the logging directory"):
            check_run_paths(get_tracker_class("mlflow"), run, str(tmp_path))
    else:
        check_run_paths(get_tracker_class("mlflow"), run, str(tmp_path))


_MEMORY_SCRIPT = """
import sys, warnings
from accelkit.cli.main import main
from accelkit.trackers.delivery.journal import Journal
from tests.helpers.memory import peak_kib

warnings.simplefilter("ignore")
code = main(["track", "status", LOGDIR, "--json"])
journal = Journal.open(LOGDIR, "jsonl")  # what a job starting on this directory does
print("next_seq", journal.next_seq, "code", code)
print("maxrss_kb", peak_kib())
"""


def _line(seq: int) -> bytes:
    return (
        json.dumps({"seq": seq, "kind": "log", "step": seq, "time": 1.0, "values": {}}) + "\n"
    ).encode()


def _sparse(path: Path, head: bytes, tail: bytes = b"") -> None:
    """``head``, then zeros without a newline up to 2 GiB (a hole: no disk used), then
    ``tail``."""
    path.write_bytes(head)
    with open(path, "r+b") as file:
        file.truncate(2**31)
        file.seek(0, os.SEEK_END)
        file.write(tail)


@pytest.mark.slow
def test_a_sparse_2_gib_segment_line_is_never_read_whole(tmp_path: Path) -> None:
    folder = tmp_path / JOURNAL_FOLDER / "jsonl"
    folder.mkdir(parents=True)
    # A 2 GiB line between two entries, and a last segment ending in 2 GiB without a newline.
    _sparse(folder / "000000000000.jsonl", _line(0), b"\n" + _line(1))
    _sparse(folder / "000000000002.jsonl", _line(2))

    result = subprocess.run(
        [sys.executable, "-c", f"LOGDIR = {str(tmp_path)!r}\n" + textwrap.dedent(_MEMORY_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(
            PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
        ),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (row,) = [json.loads(line) for line in lines if line.startswith("{")]
    # The entries before and after the damaged line are read; the line itself is reported.
    assert (row["journaled"], row["pending"]) == (3, 3)
    damaged = [problem for problem in row["problems"] if "line 2: cut short or too long" in problem]
    assert {Path(problem.split(" line ")[0]).name for problem in damaged} == {
        "000000000000.jsonl",
        "000000000002.jsonl",
    }
    assert "next_seq 3 code 1" in lines
    (rss,) = [int(line.split()[1]) for line in lines if line.startswith("maxrss_kb")]
    assert rss < 500 * 1024, f"peak memory {rss // 1024} MB reading a 2 GiB line"


def test_a_line_with_a_valid_seq_but_damaged_values_costs_only_that_line(tmp_path: Path) -> None:
    """Opening a journal reads each line of its last segment only up to its ``seq`` (it does
    not parse the values twice). A crafted last line that begins like an entry but is damaged
    after its ``seq`` moves ``next_seq`` past it (a gap, never a reused number) and is reported,
    with its number, when the entries are read to be sent; the entries around it are sent."""
    folder = tmp_path / JOURNAL_FOLDER / "jsonl"
    journal = Journal.open(str(tmp_path), "jsonl")
    journal.write([journal.entry("log", step, {"x": float(step)}) for step in range(3)])
    journal.close()
    (segment,) = folder.glob("*.jsonl")
    with open(segment, "ab") as file:
        file.write(b'{"seq":7,"kind":"log",' + b"\xff" * 64 + b"\n")
    with pytest.warns(UserWarning, match=r"line 4: not a journal entry; skipped"):
        reopened = Journal.open(str(tmp_path), "jsonl")
        pending = reopened.pending()
    assert [entry.step for entry in pending] == [0, 1, 2]
    assert reopened.next_seq == 8  # past the crafted seq: no later entry can reuse it
    reopened.write([reopened.entry("log", 3, {"x": 3.0})])
    with pytest.warns(UserWarning, match=r"line 4: not a journal entry"):
        assert [(e.seq, e.step) for e in reopened.pending()][-1] == (8, 3)
    reopened.close()
