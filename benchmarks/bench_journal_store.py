"""The tracker journal's store: segmented JSONL + a memory-mapped ``acked`` against ``sqlite3``.

Issue #38 item 8 asks whether the journal (``accelkit/trackers/delivery/journal.py``) should keep
its own files or use the standard library's ``sqlite3`` in WAL mode. Both stores run the tracker
worker's cycle side by side, alternating rounds, on the same entries:

- **deliver**: for each batch of ``--batch`` value sets (what the worker drains per poll), make
  the entries, write them in one go, record "sending up to seq", then "acked up to seq" (the
  backend call between them is not timed). The figure is the worker thread's CPU time per
  value set (``time.thread_time_ns``: CPU, not wall time, so other work on the machine inflates
  it far less), the cost that shares the GIL with the training loop.
- **catch up**: reopen the store and read back every undelivered entry (what a resumed job or
  ``accelkit track sync`` does after an outage), seconds per 100,000 entries.
- **disk**: bytes on disk for the same entries.

Durability is the same on both sides: no ``fsync`` per batch (the journal never syncs on the hot
path; sqlite with ``synchronous=NORMAL`` in WAL mode does not sync at commit either), so each
survives a killed process, not a power cut between checkpoints of the OS.

Usage::

    python -m benchmarks.bench_journal_store [--quick] [--batch 50]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Target, median, print_table, rmtree, scratch_dir, write_result


def _values(step: int) -> dict[str, float]:
    return {"loss": 1.0 / (step + 1), "lr": 1e-3 * (1 - step / 1e6), "grad_norm": 0.5 + step % 7}


class JsonlStore:
    """accelkit's journal, driven as the worker drives it."""

    def __init__(self, folder: Path) -> None:
        from accelkit.trackers.delivery.journal import Journal

        folder.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(str(folder), max_bytes=4 * 2**30)
        self.journal.load()

    def deliver(self, steps: range) -> None:
        journal = self.journal
        entries = [journal.entry("log", step, _values(step)) for step in steps]
        journal.write(entries)
        journal.sending(entries[-1].seq)
        journal.ack(entries[-1].seq)

    def pending_after(self, acked: int) -> int:
        self.journal.acked = acked
        return len(self.journal.pending())

    def close(self) -> None:
        self.journal.close()


class SqliteStore:
    """The same cycle on ``sqlite3`` in WAL mode: one transaction per batch (the inserts and
    "sending"), one for "acked"."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(folder / "journal.db", isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY, kind TEXT, "
            "step INTEGER, time REAL, payload TEXT)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS ack (id INTEGER PRIMARY KEY, acked INTEGER, "
            "sending INTEGER)"
        )
        self.db.execute("INSERT OR IGNORE INTO ack VALUES (0, -1, -1)")
        row = self.db.execute("SELECT max(seq) FROM entries").fetchone()
        self.next_seq = 0 if row[0] is None else row[0] + 1

    def deliver(self, steps: range) -> None:
        rows = []
        now = time.time()
        for step in steps:
            rows.append((self.next_seq, "log", step, now, json.dumps(_values(step))))
            self.next_seq += 1
        last = rows[-1][0]
        db = self.db
        db.execute("BEGIN")
        db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?)", rows)
        db.execute("UPDATE ack SET sending = ? WHERE id = 0", (last,))
        db.execute("COMMIT")
        db.execute("UPDATE ack SET acked = ?, sending = ? WHERE id = 0", (last, last))

    def pending_after(self, acked: int) -> int:
        rows = self.db.execute(
            "SELECT seq, kind, step, time, payload FROM entries WHERE seq > ? ORDER BY seq",
            (acked,),
        ).fetchall()
        return sum(1 for row in rows if json.loads(row[4]))

    def close(self) -> None:
        self.db.close()


STORES: dict[str, Any] = {"jsonl + mmap ack": JsonlStore, "sqlite3 WAL": SqliteStore}


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(quick: bool = False, batch: int = 50) -> None:
    """Measure, print a table, and write ``benchmarks/results/journal_store.json``."""
    rounds, per_round = (4, 5_000) if quick else (9, 50_000)
    scratch = scratch_dir("journal-store")
    cpu_ns: dict[str, list[float]] = {name: [] for name in STORES}
    read_s: dict[str, list[float]] = {name: [] for name in STORES}
    disk: dict[str, int] = {}
    try:
        stores = {name: kind(scratch / str(i)) for i, (name, kind) in enumerate(STORES.items())}
        order = list(STORES)
        for round_ in range(rounds):
            order = order[1:] + order[:1]
            for name in order:
                store = stores[name]
                first = round_ * per_round
                begin = time.thread_time_ns()
                for start in range(first, first + per_round, batch):
                    store.deliver(range(start, min(start + batch, first + per_round)))
                cpu_ns[name].append((time.thread_time_ns() - begin) / per_round)
        for i, name in enumerate(STORES):
            stores[name].close()
            disk[name] = _disk_bytes(scratch / str(i))
        total = rounds * per_round
        for _ in range(3):  # catch-up: a fresh reader each time, everything undelivered
            for i, (name, kind) in enumerate(STORES.items()):
                begin = time.perf_counter()
                reader = kind(scratch / str(i))
                found = reader.pending_after(-1)
                read_s[name].append((time.perf_counter() - begin) * 100_000 / total)
                reader.close()
                assert found == total, (name, found, total)
    finally:
        rmtree(scratch)
    jsonl, sqlite = STORES
    deliver = {name: median(values) / 1000 for name, values in cpu_ns.items()}
    catch_up = {name: median(values) for name, values in read_s.items()}
    print_table(
        [
            [name, deliver[name], catch_up[name], disk[name] / (rounds * per_round)]
            for name in STORES
        ],
        ["store", "deliver, us CPU per value set", "catch-up, s per 100k", "bytes per entry"],
    )
    ratio = deliver[sqlite] / deliver[jsonl]
    results = {
        "deliver_cpu_us_per_value_set": deliver,
        "catch_up_s_per_100k": catch_up,
        "bytes_per_entry": {name: disk[name] / (rounds * per_round) for name in STORES},
        "sqlite_over_jsonl_deliver": ratio,
        "sqlite_over_jsonl_catch_up": catch_up[sqlite] / catch_up[jsonl],
        "batch": batch,
        "rounds": rounds,
        "value_sets_per_round": per_round,
        "cpu_count": os.cpu_count(),
    }
    targets = [
        Target(
            "journal's worker CPU per value set, sqlite3 WAL / ours (ours stays if >= 1)",
            ratio,
            1.0,
            "x",
            True,
        )
    ]
    notes = [
        "Same entries, same durability (no fsync per batch on either side), alternating rounds;"
        " CPU time of the delivering thread, medians over rounds.",
    ]
    path = write_result(
        "journal_store",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Tracker journal store: JSONL segments vs sqlite3",
    )
    print(f"\nsqlite3 / jsonl worker CPU: {ratio:.2f}x; wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args()
    main(quick=args.quick, batch=args.batch)
