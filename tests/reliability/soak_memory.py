"""Issue 39's acceptance soak for the memory tier (not collected by pytest): SIGKILL one worker of
a real 2-process job at a random step, let ``accelkit launch --max_restarts 1`` restart the group,
and check that every trial resumes from memory and ends bitwise equal to an uninterrupted run.

Each trial runs the job of ``tests/cli/test_launch_memory_tier.py`` (20 optimizer steps, a
snapshot every 4, a ``save_state()`` at step 5, ``load_state()`` at every start) with a state of
``--mb`` MB (model + AdamW), and kills a random rank at a random step in 6..19, *without* waiting
for the snapshot in flight: the kill may land while a snapshot or its peer copy is written. A
trial passes when the launcher exits 0 after the restart, the restart loaded a memory snapshot
(the results count how many) or, when none every process had committed was newer than the disk,
the disk's checkpoint, the job's weights, optimizer state and torch RNG end bitwise equal to the
reference's, and the job's shared memory is gone.

Run: ``python -m tests.reliability.soak_memory [--trials 20] [--mb 96]``; writes
``tests/reliability/results/soak_memory.json`` after every trial (``--results`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cli.test_launch_memory_tier import JOB, launch_args

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "reliability" / "results" / "soak_memory.json"


def _launch(
    script: Path, out: Path, mode: str, project: Path, *extra: str, env: dict[str, str]
) -> tuple[int, str, float]:
    start = time.monotonic()
    command = launch_args(script, str(out), mode, str(project), *extra, restarts=1)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    return proc.returncode, proc.stderr, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--mb", type=float, default=96.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    width = max(16, int(args.mb * 2**20 / (12 * 8)))
    env = {**os.environ, "MEMORY_JOB_WIDTH": str(width), "PYTHONPATH": str(ROOT)}
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="accelkit-soak-memory-") as tmp:
        folder = Path(tmp)
        script = folder / "job.py"
        script.write_text(JOB)
        code, err, reference_seconds = _launch(
            script, folder / "ref.json", "plain", folder / "ref", env=env
        )
        if code != 0:
            print(err[-4000:])
            return 1
        reference = json.loads((folder / "ref.json").read_text())
        trials: list[dict[str, Any]] = []
        for trial in range(args.trials):
            kill_at, rank = rng.randint(6, 19), rng.randint(0, 1)
            out = folder / f"t{trial}.json"
            code, err, seconds = _launch(
                script,
                out,
                "kill",
                folder / f"t{trial}",
                str(kill_at),
                str(rank),
                "nowait",
                env=env,
            )
            got = json.loads(out.read_text()) if out.exists() else {}
            loaded = got.get("loaded") or ""
            record = {
                "trial": trial,
                "kill_at": kill_at,
                "rank": rank,
                "exit": code,
                "seconds": round(seconds, 1),
                "attempt": got.get("attempt"),
                "loaded": loaded.rsplit("/", 2)[-2:] if loaded else None,
                "from_memory": "/snapshot_" in loaded,
                "bitwise": got.get("digest") == reference["digest"],
                "memory_gone": bool(got.get("memory")) and not os.path.exists(got["memory"]),
            }
            record["passed"] = (
                code == 0
                and got.get("attempt") == 1
                and record["bitwise"]
                and record["memory_gone"]
                and bool(loaded)
            )
            if not record["passed"]:
                record["stderr_tail"] = err[-3000:]
            trials.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "stderr_tail"}), flush=True)
            summary = {
                "trials": len(trials),
                "passed": sum(t["passed"] for t in trials),
                "from_memory": sum(t["from_memory"] for t in trials),
                "state_mb": args.mb,
                "reference_seconds": round(reference_seconds, 1),
                "results": trials,
            }
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(t["passed"] for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
