"""Two runs pointed at the same ``project_dir``: the second is refused, nothing is corrupted.

accelkit's choice (see ``accelkit/checkpointing/commit/lock.py``): every automatic save holds
``<project_dir>/.accelkit-run.lock`` while it claims its folder, writes, commits and rotates; a
save from another live process is refused with a ``CheckpointError`` naming the holder and the
fix, and under the lock an existing folder name is refused too. A lock left by a dead process
(a crash, SIGKILL) is taken over, so a restarted run resumes. Distinct names alone would not be
enough: each run's ``total_limit`` would delete the other's checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import Zygote, trials

SAVES = 5


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_second_run_on_the_same_project_is_refused(
    storage: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    zygote: Zygote,
    summary: dict[str, Any],
) -> None:
    if storage == "s3":
        server = request.getfixturevalue("s3_server")
        project, options = server.new_prefix(), server.storage_options
    else:
        project, options = str(tmp_path / "project"), {}
    count = trials(1, 5)
    held = 0
    by_lock = 0
    for trial in range(count):
        pids = {}
        for run in (1, 2):  # started back to back: they race for the first save
            pids[run] = zygote.call(
                cmd="save",
                project=project,
                options=options,
                total_limit=3,
                run=run,
                events=str(tmp_path / f"events-{trial}-{run}.txt"),
                log=str(tmp_path / f"saver-{run}.log"),
                saves=SAVES,
            )["pid"]
        status = {run: zygote.call(cmd="wait", pid=pid)["status"] for run, pid in pids.items()}
        events = {
            run: (tmp_path / f"events-{trial}-{run}.txt").read_text().splitlines() for run in pids
        }
        winners = [run for run in pids if status[run] == 0]
        assert len(winners) == 1, (status, events)
        (winner,) = winners
        loser = 3 - winner
        committed = [line for line in events[winner] if line.startswith("committed")]
        assert len(committed) == SAVES, events[winner]
        refused = [line for line in events[loser] if line.startswith("refused")]
        # The lock is held per save, so the loser may have committed a save before the two runs
        # first met; from that save on it is refused and stops.
        assert refused
        assert events[loser][-1].startswith("refused"), events[loser]
        message = json.loads(refused[0].split(" ", 1)[1].rsplit(" @", 1)[0])
        # Refused by the save lock (the other run was saving at that moment) or, under the
        # lock, by the name the other run's committed checkpoint already has.
        assert ("another run" in message and "pid" in message) or (
            "already exists" in message and "another run" in message
        ), message
        by_lock += "is in use by another run" in message

        result = zygote.call(
            cmd="check",
            project=project,
            options=options,
            out=str(tmp_path / f"check-{trial}.json"),
            log=str(tmp_path / "checker.log"),
        )["result"]
        assert result["corrupt"] == {} and result["problems"] == [], result
        assert result["loaded_run"] == winner and result["verify_rc"] == 0, result
        held += 1
    summary[f"concurrent_writers_{storage}"] = {
        "trials": count,
        "held": held,
        "behaviour": "one run saves, the other is refused",
        "refused_by_the_save_lock": by_lock,
        "refused_by_the_existing_folder_name": held - by_lock,
    }


def test_lock_holders_live_dead_and_remote(tmp_path: Path) -> None:
    """Who may take the save lock: never from a live process; always from a dead one; from
    another host only once the lock is older than ``STALE_AFTER_S``."""
    import os
    import subprocess
    import time

    from accelkit.checkpointing.commit.lock import LOCK_NAME, STALE_AFTER_S, RunLock, _start_time
    from accelkit.checkpointing.errors import CheckpointError
    from accelkit.checkpointing.storage import get_storage

    project = str(tmp_path / "project")
    lock_file = tmp_path / "project" / LOCK_NAME
    lock = RunLock(get_storage(project), project)

    def plant(**holder: Any) -> None:
        lock_file.parent.mkdir(exist_ok=True)
        lock_file.write_text(json.dumps(holder))

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = {"host": lock.host, "pid": sleeper.pid, "started": _start_time(sleeper.pid)}
        plant(**live, updated=time.time())
        with pytest.raises(CheckpointError, match=rf"pid {sleeper.pid} .*{LOCK_NAME}"):
            lock.acquire()
        # The same pid, restarted later (pid reuse), does not hold it.
        plant(**{**live, "started": "1"}, updated=time.time())
        lock.acquire()
        lock.release()
        assert not lock_file.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    plant(**live, updated=time.time())  # its process has exited: stale
    lock.acquire()
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()
    plant(host="elsewhere", pid=1, started="1", updated=time.time())
    with pytest.raises(CheckpointError, match="elsewhere"):
        lock.acquire()
    plant(host="elsewhere", pid=1, started="1", updated=time.time() - STALE_AFTER_S - 5)
    lock.acquire()
    lock_file.write_text("{not json")  # unreadable: stale
    lock.release()  # not ours any more: left alone
    assert lock_file.exists()
    lock.acquire()
    lock.release()
    assert not lock_file.exists()
