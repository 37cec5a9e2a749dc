"""Test processes: whether one still runs and what it started (through ``/proc``), and waiting
for a job without leaving its workers behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["alive", "descendants", "finish", "setup_race"]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper has stopped running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``: its children, their children, and so on."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def finish(process: subprocess.Popen[str], timeout: float) -> tuple[int | None, str, str]:
    """Wait for ``process``, started with ``start_new_session=True``: its exit status (None on
    timeout), stdout and stderr (``""`` where not piped). On timeout its whole session (a
    launcher and its workers) is killed, so no worker outlives the test."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return None, out or "", err or ""
    return process.returncode, out or "", err or ""


# What a job prints when it lost a race with another program on this machine while it set up,
# before any of the code under test ran: its free rendezvous port was taken between being found
# and being bound, or a gloo peer connection was cut while the group formed (torch's
# ``connectFullMesh``: seen about once in six whole-suite runs, with 2 cores shared by two
# pytest workers and their jobs). A job failed so proves nothing and may be run once more.
_SETUP_RACES = (
    "EADDRINUSE",
    "Address already in use",
    "address already in use",
    "connectFullMesh failed with [",
)


def setup_race(output: str) -> str | None:
    """The marker of a set-up race (see ``_SETUP_RACES``) in a failed job's ``output``, or
    ``None``. A gloo refusal (``Connection refused``) is not one: a restarted group reading dead
    peers' addresses fails so, and the tests that guard that fix must see it."""
    for marker in _SETUP_RACES:
        at = output.find(marker)
        if at >= 0 and "Connection refused" not in output[at : at + 300]:
            return marker
    return None
