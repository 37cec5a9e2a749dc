"""``python -m benchmarks [--quick] [--only NAME ...]``: run every benchmark, then the report.

Each benchmark is a module ``benchmarks/bench_<name>.py`` with ``main(quick: bool)`` or a
command-line ``main(argv)`` that accepts ``--quick``; it writes
``benchmarks/results/<name>.json``. Every ``bench_*.py`` in this folder runs (the known ones
first, in the order below). A benchmark that fails is reported with its traceback and the
others still run; the exit code is 1 if any failed. At the end of a full run the README
table is regenerated from the JSON files (``python -m benchmarks.report``); a ``--quick`` run
writes to ``benchmarks/results/quick/`` and only prints its targets.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import time
import traceback
from pathlib import Path

from benchmarks.common import results_dir

# Offline, no telemetry: tracker SDKs must not reach the network from a benchmark either.
for _key, _value in {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DVC_STUDIO_OFFLINE": "true",
    "COMET_ERROR_TRACKING_ENABLE": "false",
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "AWS_EC2_METADATA_DISABLED": "true",
    "HF_HUB_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_key, _value)

# Order: the disk-heavy ones first, the CPU-only ones last; any other bench_*.py after them.
_KNOWN = ["save_load", "async", "s3", "scaling", "trackers", "step"]
_FOUND = sorted(p.stem[len("bench_") :] for p in Path(__file__).parent.glob("bench_*.py"))
BENCHMARKS = _KNOWN + [name for name in _FOUND if name not in _KNOWN]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (< 2 min)")
    parser.add_argument(
        "--only", nargs="+", choices=BENCHMARKS, metavar="NAME", help=f"subset of {BENCHMARKS}"
    )
    parser.add_argument("--no-report", action="store_true", help="do not update README.md")
    args = parser.parse_args(argv)

    failed: list[str] = []
    start = time.perf_counter()
    for name in args.only or BENCHMARKS:
        try:
            module = importlib.import_module(f"benchmarks.bench_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"benchmarks.bench_{name}":
                print(f"\n== {name}: benchmarks/bench_{name}.py not present, skipped")
                continue
            raise
        entry = getattr(module, "main", None)
        if entry is None:
            print(f"\n== {name}: benchmarks/bench_{name}.py has no main(quick), skipped")
            continue
        t0 = time.perf_counter()
        try:
            # Two conventions: main(quick: bool) or a command line main(argv: list[str]).
            params = inspect.signature(entry).parameters
            if "quick" in params:
                entry(quick=args.quick)
            else:
                argv_ = ["--quick"] if args.quick else []
                if args.quick and "--out" in inspect.getsource(module):
                    # Keep quick results out of the committed ones (see common.results_dir).
                    argv_ += ["--out", str(results_dir(True) / f"{name}.json")]
                entry(argv_)
        except Exception:
            failed.append(name)
            print(f"\n!! benchmark {name} failed:\n{traceback.format_exc()}")
        print(f"   [{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    print(f"\nall benchmarks: {time.perf_counter() - start:.1f} s")
    if not args.no_report:
        from benchmarks import report

        # A quick run only prints its targets; the README shows the full-mode results.
        report.main(["--quick"] if args.quick else [])
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
