"""How long ``log()`` blocks the training loop: accelkit vs Hugging Face accelerate.

For each backend (TensorBoard, MLflow with a sqlite store, wandb offline, and accelkit's jsonl)
a fresh interpreter builds one accelkit ``Accelerator`` and one accelerate ``Accelerator`` on
the same backend, then alternates rounds of ``log()`` calls between the two and times every
call with ``perf_counter_ns``. Between rounds accelkit's queue is drained (not timed) so its
background writes never overlap accelerate's round. Two patterns are measured: calls back to
back (the worst case for a background writer, which then competes for the GIL) and calls
separated by a simulated training step that releases the GIL (``--step-us``, default 1000 µs).
Each pattern also times an empty function call the same way: after a sleep, caches and CPU
frequency are cold and even an empty call costs microseconds on a busy machine; that floor is
reported as ``empty_call``.

A third job (``worker_cpu``) measures what the tracker journal costs where it runs: the CPU time
of each tracker's worker thread per logged value set (``pthread_getcpuclockid``: CPU time, not
wall time, so other work on the machine inflates it far less than a timed step), journal on and
off, alternating, best of 3. That thread shares the GIL with the training loop, so its extra CPU
per step bounds what the journal can take from a training step.

A second job runs accelkit in two real processes (gloo on 127.0.0.1) and times ``log()`` on the
non-main process, where no tracker exists (batches of calls, to stay above the timer's noise).

Usage::

    python -m benchmarks.bench_trackers [--quick] [--out benchmarks/results/trackers.json]

Results are printed as a table and written as JSON (medians and p90 in microseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "COMET_ERROR_TRACKING_ENABLE": "false",
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DVC_STUDIO_OFFLINE": "true",
    "DO_NOT_TRACK": "1",
    "GIT_PYTHON_REFRESH": "quiet",
}
BACKENDS = ["tensorboard", "mlflow", "wandb", "jsonl"]
ROOT = Path(__file__).resolve().parents[1]


def _values(step: int) -> dict[str, float]:
    return {"loss": 1.0 / (step + 1), "lr": 1e-3 * (1 - step / 1e6), "grad_norm": 0.5 + step % 7}


def _summary(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    return {
        "median_us": statistics.median(ordered) / 1000,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] / 1000,
        "mean_us": statistics.fmean(ordered) / 1000,
        "calls": len(ordered),
    }


def _empty(values: dict[str, float], step: int | None = None) -> None:
    """Baseline: what calling any function costs in the same loop (caches, timer, wake-up)."""


def _time_calls(log: Any, start: int, calls: int, step_s: float) -> list[int]:
    clock = time.perf_counter_ns
    samples = []
    for step in range(start, start + calls):
        values = _values(step)
        begin = clock()
        log(values, step=step)
        samples.append(clock() - begin)
        if step_s:
            time.sleep(step_s)
    return samples


def _make_pair(backend: str, work: Path) -> tuple[Any, Any]:
    """An accelkit and an accelerate Accelerator logging to ``backend`` under ``work``."""
    import accelerate

    import accelkit

    kit_kwargs: dict[str, Any] = {}
    ref_kwargs: dict[str, Any] = {}
    if backend == "mlflow":
        # accelerate's tracker uses MLflow's global URI; accelkit gets its own store.
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'accelerate' / 'mlflow.db'}"
        kit_kwargs = {"mlflow": {"tracking_uri": f"sqlite:///{work / 'accelkit' / 'mlflow.db'}"}}
    if backend == "wandb":
        kit_kwargs = {"wandb": {"reinit": "create_new"}}
        # accelerate's tracker updates the global wandb.config, so its run is the global one.
        ref_kwargs = {"wandb": {"dir": str(work / "accelerate")}}
    ref = None
    if backend != "jsonl":  # accelerate has no jsonl tracker
        ref = accelerate.Accelerator(log_with=backend, project_dir=str(work / "accelerate"))
        ref.init_trackers("bench", config={"lr": 1e-3}, init_kwargs=ref_kwargs)
    kit = accelkit.Accelerator(log_with=backend, project_dir=str(work / "accelkit"))
    kit.init_trackers("bench", config={"lr": 1e-3}, init_kwargs=kit_kwargs)
    return kit, ref


def _make_journal_off(backend: str, work: Path) -> Any:
    """accelkit with the tracker journal off (#27: journal on and off side by side)."""
    import accelkit

    kit_kwargs: dict[str, Any] = {}
    if backend == "mlflow":
        kit_kwargs = {"mlflow": {"tracking_uri": f"sqlite:///{work / 'nojournal' / 'mlflow.db'}"}}
    if backend == "wandb":
        kit_kwargs = {"wandb": {"reinit": "create_new"}}
    os.environ["ACCELKIT_TRACKER_JOURNAL"] = "0"
    try:
        kit = accelkit.Accelerator(log_with=backend, project_dir=str(work / "nojournal"))
        kit.init_trackers("bench-nojournal", config={"lr": 1e-3}, init_kwargs=kit_kwargs)
    finally:
        del os.environ["ACCELKIT_TRACKER_JOURNAL"]
    return kit


def run_backend(backend: str, rounds: int, calls: int, step_us: float) -> dict[str, Any]:
    """Child-process entry: alternate accelkit and accelerate rounds on one backend."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-trackers-{backend}-"))
    for side in ("accelkit", "accelerate", "nojournal"):
        (work / side).mkdir()
    try:
        kit, ref = _make_pair(backend, work)
        off = _make_journal_off(backend, work)
        results: dict[str, Any] = {}
        for pattern, step_s in (("back_to_back", 0.0), (f"step_{int(step_us)}us", step_us / 1e6)):
            samples: dict[str, list[int]] = {
                "accelkit": [],
                "accelkit_journal_off": [],
                "accelerate": [],
                "empty_call": [],
            }
            warm = max(10, calls // 10)
            _time_calls(kit.log, 0, warm, 0.0)
            kit._trackers.flush()
            _time_calls(off.log, 0, warm, 0.0)
            off._trackers.flush()
            if ref is not None:
                _time_calls(ref.log, 0, warm, 0.0)
            step = warm
            for _ in range(rounds):
                samples["accelkit"] += _time_calls(kit.log, step, calls, step_s)
                kit._trackers.flush()  # not timed: keep accelkit's writes out of the next round
                samples["accelkit_journal_off"] += _time_calls(off.log, step, calls, step_s)
                off._trackers.flush()
                if ref is not None:
                    samples["accelerate"] += _time_calls(ref.log, step, calls, step_s)
                # The timer's floor for this pattern: a function that does nothing.
                samples["empty_call"] += _time_calls(_empty, step, calls, step_s)
                step += calls
            results[pattern] = {lib: _summary(s) for lib, s in samples.items() if s}
        begin = time.perf_counter()
        kit.end_training()
        results["accelkit_end_training_s"] = time.perf_counter() - begin
        off.end_training()
        if ref is not None:
            ref.end_training()
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _non_main_job(calls: int, repeats: int) -> dict[str, Any]:
    import accelkit

    work = tempfile.mkdtemp(prefix="bench-trackers-dist-")
    accelerator = accelkit.Accelerator(
        log_with=["tensorboard", "jsonl", "mlflow", "wandb"], project_dir=work
    )
    accelerator.init_trackers("bench")
    per_call: list[float] = []
    if not accelerator.is_main_process:
        log = accelerator.log
        values = _values(0)
        clock = time.perf_counter_ns
        for _ in range(repeats):
            begin = clock()
            for step in range(calls):
                log(values, step=step)
            per_call.append((clock() - begin) / calls / 1000)
    accelerator.end_training()
    accelerator.wait_for_everyone()
    return {"rank": accelerator.process_index, "per_call_us": per_call}


def run_non_main(calls: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_non_main_job, calls, repeats, world_size=2, env=OFFLINE_ENV)
    per_call = results[1]["per_call_us"]
    return {
        "median_us": statistics.median(per_call),
        "min_us": min(per_call),
        "max_us": max(per_call),
        "calls_per_batch": calls,
        "batches": repeats,
    }


def _worker_cpu_us(backend: str, journal: bool, entries: int, work: Path) -> float:
    """Worker-thread CPU microseconds per ``log()`` of 3 floats to ``backend`` (one hub)."""
    from accelkit.trackers.delivery.hub import TrackerHub

    folder = work / f"{backend}-{journal}-{time.monotonic_ns()}"
    folder.mkdir()
    kwargs: dict[str, Any] = {}
    if backend == "mlflow":
        kwargs = {"mlflow": {"tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"}}
    if backend == "wandb":
        kwargs = {"wandb": {"dir": str(folder)}}
    hub = TrackerHub.create([backend], logging_dir=str(folder), journal=journal)
    hub.init("bench-worker-cpu", init_kwargs=kwargs)
    hub.flush()
    (worker,) = hub._roster.workers
    clock = time.pthread_getcpuclockid(worker.thread.ident)  # type: ignore[arg-type]
    begin = time.clock_gettime(clock)
    chunk = 50  # a 50 ms poll of a 1 ms step: what the worker finds waiting
    for first in range(0, entries, chunk):
        for step in range(first, first + chunk):
            hub.log(_values(step), step=step)
        hub.flush()
    spent = time.clock_gettime(clock) - begin
    hub.finish()
    return spent / entries * 1e6


def run_worker_cpu(entries: int, repeats: int = 3) -> dict[str, Any]:
    """Child-process entry: worker CPU per value set, journal on and off, per backend."""
    # MLflow's sqlite store takes seconds to create on a busy machine: not a start to give up on.
    os.environ.setdefault("ACCELKIT_TRACKER_TIMEOUT", "600")
    work = Path(tempfile.mkdtemp(prefix="bench-trackers-worker-cpu-"))
    results: dict[str, Any] = {}
    try:
        for backend in BACKENDS:
            count = entries if backend in ("jsonl", "tensorboard") else max(500, entries // 10)
            best = {"on": float("inf"), "off": float("inf")}
            for _ in range(repeats):
                for side, journal in (("on", True), ("off", False)):
                    best[side] = min(best[side], _worker_cpu_us(backend, journal, count, work))
            results[backend] = {
                "journal_on_us": best["on"],
                "journal_off_us": best["off"],
                "journal_extra_us": best["on"] - best["off"],
                "entries": count,
            }
        results["load_average"] = list(os.getloadavg())
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _child(args: argparse.Namespace) -> None:
    os.environ.update(OFFLINE_ENV)
    if args.backend == "worker_cpu":
        result = run_worker_cpu(args.calls * 20)
    elif args.backend == "non_main":
        result = run_non_main(args.calls * 10, args.rounds * 4)
    else:
        result = run_backend(args.backend, args.rounds, args.calls, args.step_us)
    print("RESULT " + json.dumps(result))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("accelkit", "accelerate", "torch", "tensorboard", "mlflow", "wandb"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "missing"
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trackers.json"))
    parser.add_argument("--step-us", type=float, default=1000.0)
    parser.add_argument("--backends", default=None, help="default: all (quick: tensorboard)")
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.calls = args.calls or (100 if args.quick else 300)
    # Each backend runs in a fresh interpreter that imports torch and the SDK; in quick mode
    # (the 2-minute development run) one backend beside the non-main case is enough.
    quick_backends = ["tensorboard", "non_main", "worker_cpu"]
    args.backends = args.backends or ",".join(
        quick_backends if args.quick else [*BACKENDS, "non_main", "worker_cpu"]
    )
    if args.backend:
        _child(args)
        return

    report: dict[str, Any] = {
        "benchmark": "time log() blocks the caller (microseconds per call)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "versions": _versions(),
        "settings": {"quick": args.quick, "rounds": args.rounds, "calls_per_round": args.calls,
                     "step_us": args.step_us},
        "results": {},
    }  # fmt: skip
    for backend in args.backends.split(","):
        command = [sys.executable, "-m", "benchmarks.bench_trackers", "--backend", backend,
                   "--rounds", str(args.rounds), "--calls", str(args.calls),
                   "--step-us", str(args.step_us)]  # fmt: skip
        began = time.perf_counter()
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **OFFLINE_ENV}
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            report["results"][backend] = {"error": done.stderr[-2000:]}
            print(f"{backend}: FAILED\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        result["wall_s"] = round(time.perf_counter() - began, 1)
        report["results"][backend] = result
        _print(backend, result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _print(backend: str, result: dict[str, Any]) -> None:
    if backend == "worker_cpu":
        for name, row in result.items():
            if isinstance(row, dict):
                print(
                    f"worker CPU     {name:<12} journal on {row['journal_on_us']:7.1f} us | off "
                    f"{row['journal_off_us']:7.1f} us | extra {row['journal_extra_us']:+6.1f} us"
                    " per log()"
                )
        return
    if backend == "non_main":
        print(f"{'non-main process':<14} accelkit median {result['median_us']:.3f} us/call")
        return
    for pattern, sides in result.items():
        if not isinstance(sides, dict):
            continue
        kit = sides["accelkit"]["median_us"]
        floor = sides["empty_call"]["median_us"]
        line = f"{backend:<12} {pattern:<14} empty call {floor:5.1f} us | accelkit {kit:8.1f} us"
        if "accelkit_journal_off" in sides:
            line += f" (journal off {sides['accelkit_journal_off']['median_us']:6.1f} us)"
        if "accelerate" in sides:
            ref = sides["accelerate"]["median_us"]
            sides["speedup_median"] = ref / kit
            line += f" | accelerate {ref:8.1f} us | x{ref / kit:.0f}"
        print(line)


if __name__ == "__main__":
    main()
