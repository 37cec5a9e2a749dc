"""Soak: an MLflow server outage during a 2-process run loses no point (#27's acceptance run).

Not collected by pytest (its name does not start with ``test_``); run it by hand:

    python -m tests.reliability.soak_journal [--points 10000] [--kill-at 30] [--down 60]

It starts a real ``mlflow server`` on 127.0.0.1 (sqlite store), then runs the same 2-process job
(gloo on 127.0.0.1, a fixed amount of work per step, ``log()`` to jsonl, TensorBoard and the
server on the main process) twice: once without an outage (the baseline), once with the server
killed ``--kill-at`` seconds in and restarted ``--down`` seconds later on the same store and
port. Afterwards it checks, for the outage run, that ``MlflowClient().get_metric_history``
returns every point exactly once at its step (running ``accelkit track sync`` first if the run
ended before the server caught up), that the jsonl and TensorBoard trackers have every point,
and compares the training throughput (steps per second of the training loop) of the two runs.
Results are printed and written to ``benchmarks/results/soak_journal.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.trackers.conftest import OFFLINE_ENV  # noqa: E402
from tests.trackers.test_journal_mlflow import _CLIENT_ENV, Server  # noqa: E402

JOB = """
import json, sys, time, torch, torch.distributed as dist
from accelkit import Accelerator
points, url, out, work = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
accelerator = Accelerator(log_with=["jsonl", "tensorboard", "mlflow"], project_dir=out)
accelerator.init_trackers("soak", init_kwargs={"mlflow": {"tracking_uri": url}})
weight = torch.randn(192, 192)
torch.set_num_threads(1)
begin = time.perf_counter()
for step in range(points):
    x = torch.randn(64, 192)
    for _ in range(work):
        x = torch.tanh(x @ weight)
    loss = x.square().mean()
    total = loss.detach().clone()
    dist.all_reduce(total)
    accelerator.log({"loss": float(step), "reduced": total}, step=step)
elapsed = time.perf_counter() - begin
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    timing = {"seconds": elapsed, "steps_per_s": points / elapsed}
    json.dump(timing, open(out + "/timing.json", "w"))
accelerator.end_training()
"""


def _run_job(points: int, url: str, out: Path, env: dict[str, str], work: int) -> dict[str, float]:
    script = out.parent / "soak_job.py"
    script.write_text(JOB)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(script), str(points), url, str(out), str(work),
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, cwd=out.parent)
    return json.loads((out / "timing.json").read_text())


def _free_port() -> int:
    from tests.helpers.distributed import free_port

    return free_port()


def _history(url: str, project: Path) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url)
    run_id = json.loads((project / "accelkit-journal" / "mlflow" / "run.json").read_text())[
        "reference"
    ]["run_id"]
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=10_000)
    parser.add_argument("--kill-at", type=float, default=30.0)
    parser.add_argument("--down", type=float, default=60.0)
    parser.add_argument("--work", type=int, default=40, help="matmuls per step")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak_journal.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="soak-journal-"))
    env = {
        **os.environ,
        **OFFLINE_ENV,
        **_CLIENT_ENV,
        "PYTHONPATH": str(ROOT),
        "ACCELKIT_TRACKER_RETRY_MAX_S": "2",
    }
    os.environ.update({**OFFLINE_ENV, **_CLIENT_ENV})
    from mlflow import MlflowClient

    template = work / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
    (work / "server").mkdir()
    server = Server(work / "server", template)
    server.start()
    report: dict[str, object] = {
        "points": args.points,
        "processes": 2,
        "kill_at_s": args.kill_at,
        "down_s": args.down,
        "matmuls_per_step": args.work,
    }
    try:
        baseline_dir = work / "baseline"
        baseline_dir.mkdir()
        baseline = _run_job(args.points, server.url, baseline_dir, env, args.work)
        report["baseline"] = baseline

        outage_dir = work / "outage"
        outage_dir.mkdir()
        events: dict[str, float] = {}

        def outage() -> None:
            begin = time.monotonic()
            time.sleep(args.kill_at)
            server.kill()
            events["killed_at_s"] = time.monotonic() - begin
            time.sleep(args.down)
            server.start()
            events["restarted_at_s"] = time.monotonic() - begin

        thread = threading.Thread(target=outage)
        began = time.monotonic()
        thread.start()
        timing = _run_job(args.points, server.url, outage_dir, env, args.work)
        report["run_seconds"] = time.monotonic() - began
        thread.join()
        report["outage"] = {**timing, **events}
        history = _history(server.url, outage_dir)
        synced = None
        if len(history) < args.points:
            done = subprocess.run(
                [sys.executable, "-m", "accelkit.cli.main", "track", "sync", str(outage_dir)],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            synced = done.stdout.strip()
            history = _history(server.url, outage_dir)
        report["track_sync"] = synced
        expected = [(s, float(s)) for s in range(args.points)]
        report["mlflow_points"] = len(history)
        report["mlflow_exactly_once"] = history == expected
        from accelkit.trackers.jsonl import read_jsonl

        rows = read_jsonl(str(outage_dir / "soak"), metrics_only=True)
        report["jsonl_points"] = len(rows)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events_dir = next(p.parent for p in outage_dir.rglob("events.out.tfevents.*"))
        accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
        accumulator.Reload()
        report["tensorboard_points"] = len(accumulator.Scalars("loss"))
        change = (timing["steps_per_s"] / baseline["steps_per_s"] - 1.0) * 100.0
        report["throughput_change_pct"] = change
    finally:
        server.kill()
    print(json.dumps(report, indent=2))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
