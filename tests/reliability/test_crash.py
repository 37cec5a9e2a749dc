"""Crash at any moment: SIGKILL a process that saves checkpoints in a loop, then check the run.

Each trial forks a saver (see ``harness.py``) that resumes from the newest committed
checkpoint and saves in a loop with ``total_limit=3``; the test waits for it to begin a
randomly chosen save, sleeps a seeded random delay (so the kill lands before, inside or just
after that save: while files stream out, while the manifest is written, during retention),
and kills it with SIGKILL. A fresh checker process then lists the checkpoints, loads the
newest committed one, checks every loaded part carries that save's stamp, and runs
``accelkit ckpt verify``. After the last trial, one saver runs to completion (retention catches
up) and ``accelkit ckpt prune`` (the real console script) removes the stale incomplete folders.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import FULL, Zygote, seed, trials, wait_for_line

TOTAL_LIMIT = 3
# Seconds after a save begins within which the kill lands (a save takes ~30-70 ms on a local
# disk and ~100-170 ms on the local S3 server here; the window also covers retention).
WINDOW = {"local": 0.12, "s3": 0.3}


def _parse(lines: list[str]) -> tuple[list[int], list[int]]:
    begun = [int(line.split()[1]) for line in lines if line.startswith("begin ")]
    committed = [int(line.split()[1]) for line in lines if line.startswith("committed ")]
    return begun, committed


def _cli_flags(options: dict[str, Any]) -> list[str]:
    import json

    out = []
    for key, value in options.items():
        out += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_sigkill_at_random_moments(
    storage: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    zygote: Zygote,
    summary: dict[str, Any],
) -> None:
    count = trials(5, 30)
    run_seed = seed()
    print(f"crash trials on {storage}: {count} trials, seed {run_seed}")
    rng = random.Random(run_seed)
    if storage == "s3":
        server = request.getfixturevalue("s3_server")
        project, options = server.new_prefix(), server.storage_options
    else:
        project, options = str(tmp_path / "project"), {}

    logged: list[int] = []  # saves that returned (committed for sure)
    held = 0
    mid_save = 0
    incomplete_seen = 0
    for trial in range(count):
        events = tmp_path / f"events-{trial}.txt"
        pid = zygote.call(
            cmd="save",
            project=project,
            options=options,
            total_limit=TOTAL_LIMIT,
            run=0,
            events=str(events),
            log=str(tmp_path / "saver.log"),
        )["pid"]
        lines = wait_for_line(events, "ready")
        first = int(lines[0].split()[1])
        target = first + rng.randrange(3)
        delay = rng.uniform(0, WINDOW[storage])
        wait_for_line(events, f"begin {target}")
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        status = zygote.call(cmd="wait", pid=pid)["status"]
        assert status == -signal.SIGKILL, (status, (tmp_path / "saver.log").read_text()[-3000:])
        begun, committed_now = _parse(events.read_text().splitlines())
        logged += committed_now
        if begun and (not committed_now or begun[-1] > committed_now[-1]):
            mid_save += 1

        answer = zygote.call(
            cmd="check",
            project=project,
            options=options,
            out=str(tmp_path / f"check-{trial}.json"),
            log=str(tmp_path / "checker.log"),
        )
        assert answer["ok"], (tmp_path / "checker.log").read_text()[-4000:]
        result = answer["result"]
        where = f"trial {trial} (seed {run_seed}, killed {delay:.3f}s after begin {target})"
        committed = result["committed"]
        assert result["corrupt"] == {}, where
        if not logged and not committed:
            # Killed inside the very first save, in this trial and maybe in each one before it
            # (a kill 4 ms after the first save began, twice: seen once): nothing to load,
            # nothing lost, at most one incomplete folder per trial so far.
            assert result["incomplete"] == list(range(len(result["incomplete"]))), (where, result)
            assert len(result["incomplete"]) <= trial + 1, (where, result)
            held += 1
            continue
        assert committed, f"{where}: no committed checkpoint left"
        # ``logged`` may still be empty here: killed after a first save committed but before
        # the saver wrote its "committed" line. What the saver saw commit must be there.
        assert not logged or max(committed) >= max(logged), where
        # Retention keeps the newest TOTAL_LIMIT committed checkpoints: every save among the
        # newest TOTAL_LIMIT known to have committed must still be there.
        should_keep = sorted(set(logged) | set(committed))[-TOTAL_LIMIT:]
        assert set(should_keep) <= set(committed), (where, should_keep, committed)
        assert result["loaded"] == max(committed), where
        assert result["problems"] == [], (where, result["problems"])
        assert result["verify_rc"] == 0, (where, result["verify_out"])
        every = committed + result["incomplete"]
        assert result["next_iteration"] > max(every), where
        if any(i > max(committed) for i in result["incomplete"]):
            incomplete_seen += 1  # the newest folder was a half-written save: ignored
        held += 1

    # One saver that is not killed: retention catches up, incomplete folders stay.
    events = tmp_path / "events-final.txt"
    pid = zygote.call(
        cmd="save",
        project=project,
        options=options,
        total_limit=TOTAL_LIMIT,
        run=0,
        events=str(events),
        log=str(tmp_path / "saver.log"),
        saves=2,
    )["pid"]
    assert zygote.call(cmd="wait", pid=pid)["status"] == 0, (tmp_path / "saver.log").read_text()
    final = zygote.call(
        cmd="check",
        project=project,
        options=options,
        out=str(tmp_path / "check-final.json"),
        log=str(tmp_path / "checker.log"),
    )["result"]
    assert len(final["committed"]) == TOTAL_LIMIT, final
    assert final["problems"] == [] and final["verify_rc"] == 0, final
    # The real console script removes the incomplete folders older than the newest commit.
    root = project.rstrip("/") + "/checkpoints"
    cli = [sys.executable, "-m", "accelkit.cli.main"]
    pruned = subprocess.run(
        [*cli, "ckpt", "prune", root, "--keep", str(TOTAL_LIMIT), "--yes", *_cli_flags(options)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert pruned.returncode == 0, pruned.stderr
    verify = subprocess.run(
        [*cli, "ckpt", "verify", root, *_cli_flags(options)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "SKIP" not in verify.stdout, verify.stdout  # no incomplete folder left
    assert f"{TOTAL_LIMIT} of {TOTAL_LIMIT} checkpoint(s) intact" in verify.stdout

    summary[f"crash_sigkill_{storage}"] = {
        "trials": count,
        "held": held,
        "seed": run_seed,
        "killed_mid_save": mid_save,
        "newest_folder_incomplete_and_ignored": incomplete_seen,
        "full": FULL,
    }
    print(summary[f"crash_sigkill_{storage}"])
