"""How exactly transformers' ``run_glue_no_trainer.py`` resumes, under Accelerate and, its
imports renamed, under accelkit (a measurement run by hand; the figures are in
docs/guides/porting-notes.md, the last results in tests/compat/results/no_trainer_resume.json).

Usage: no_trainer_resume.py SCRIPT WORK [--processes 1 2] [--frameworks accelerate accelkit]

SCRIPT is ``examples/pytorch/text-classification/run_glue_no_trainer.py`` from a transformers
checkout (not copied into this repository; transformers 5 no longer has the
``send_example_telemetry`` it calls and the ``datasets`` stand-in is no installed distribution
for its ``require_version``: remove those lines in your copy first). It runs on the offline
stand-ins of ``tests/compat/standins`` (a tiny seeded ``bert-base-cased``, a synthetic GLUE MRPC
of 64 training rows), seed 42, 2 epochs of per-device batches of 8. For each way of saving
(``--checkpointing_steps 3``: mid-epoch; ``4``: on the last batch of an epoch, ``step_8`` on one
process and ``step_4`` on two; ``epoch``: after the epoch's evaluation), framework and process
count, it trains uninterrupted, then resumes from one of the uninterrupted run's checkpoints
with ``--resume_from_checkpoint`` (the script's own ``skip_first_batches`` idiom), and compares
the two final models tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tests.compat.examples_matrix import STANDINS, _env, port_tree  # noqa: E402

# (how the uninterrupted run saves, the checkpoint resumed from, per process count)
CASES = {
    "mid-epoch": ("3", {1: "step_3", 2: "step_3"}),
    "last batch of an epoch": ("4", {1: "step_8", 2: "step_4"}),
    "after the epoch's evaluation": ("epoch", {1: "epoch_0", 2: "epoch_0"}),
}


def _command(framework: str, processes: int, script: Path, args: list[str]) -> list[str]:
    bin_dir = Path(sys.executable).parent
    if framework == "accelkit":
        launch = [str(bin_dir / "accelkit"), "launch", "--cpu", "--num_processes", str(processes)]
    elif processes == 1:
        launch = [str(bin_dir / "accelerate"), "launch", "--cpu", "--num_processes", "1"]
    else:  # Accelerate's --cpu launcher starts one process; --multi_gpu is its torchrun one
        launch = [str(bin_dir / "accelerate"), "launch", "--multi_gpu"]
        launch += ["--num_processes", str(processes)]
    return [*launch, str(script), *args]


def _run(work: Path, framework: str, processes: int, script: Path, args: list[str]) -> float:
    env = _env(work / "hub", work / "home", framework, False, work / "examples")
    if framework == "accelerate" and processes > 1:
        env["ACCELERATE_USE_CPU"] = "True"
    started = time.perf_counter()
    proc = subprocess.run(
        _command(framework, processes, script, args),
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{framework} on {processes} failed:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - started


def _compare(a: Path, b: Path) -> tuple[int, int, float]:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    equal = sum(bool((x[k] == y[k]).all()) for k in x)
    worst = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return equal, len(x), worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--frameworks", nargs="+", default=["accelerate", "accelkit"])
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    if not (work / "hub").exists():
        subprocess.run(
            [sys.executable, str(STANDINS / "standin_hub.py"), str(work / "hub")], check=True
        )
    source = work / "src"
    source.mkdir(exist_ok=True)
    shutil.copy(args.script, source / args.script.name)
    shutil.rmtree(work / "ported", ignore_errors=True)
    port_tree(source, work / "ported")
    common = ["--task_name", "mrpc", "--model_name_or_path", "bert-base-cased", "--seed", "42"]
    common += ["--num_train_epochs", "2", "--per_device_train_batch_size", "8"]
    rows = []
    for case, (every, resumed_from) in CASES.items():
        for framework in args.frameworks:
            script = (source if framework == "accelerate" else work / "ported") / args.script.name
            for processes in args.processes:
                base = work / f"{framework}-{processes}-{every}"
                shutil.rmtree(base, ignore_errors=True)
                full, resumed = base / "full", base / "resumed"
                steps = ["--checkpointing_steps", every]
                _run(
                    work, framework, processes, script, [*common, *steps, "--output_dir", str(full)]
                )
                checkpoint = full / resumed_from[processes]
                again = [*common, *steps, "--output_dir", str(resumed)]
                _run(
                    work,
                    framework,
                    processes,
                    script,
                    [*again, "--resume_from_checkpoint", str(checkpoint)],
                )
                equal, total, worst = _compare(full, resumed)
                row = {
                    "case": case, "framework": framework, "processes": processes,
                    "resumed_from": checkpoint.name, "equal_tensors": equal, "tensors": total,
                    "max_abs_diff": worst,
                }  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    (work / "no_trainer_resume.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
