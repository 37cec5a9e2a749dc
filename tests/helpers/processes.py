"""Looking at processes through ``/proc``: whether one still runs, and what it started."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive", "descendants"]


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
