"""Run Accelerate's example scripts under Accelerate and, imports renamed, under accelkit.

Not collected by pytest (the name does not start with ``test_``). The scripts are not in
Accelerate's packages on PyPI, only in its git repository, and are never copied into this
repository: they are extracted from an Accelerate checkout or snapshot into a temporary folder
for each run::

    python tests/compat/examples_matrix.py --accelerate-repo PATH [--ref REF] \\
        [--only SUBSTRING ...] [--processes 1 2] [--out tests/compat/results/examples.json]

Each (script, arguments, process count) runs twice with the same seed: as-is under
``accelerate launch --cpu --num_processes 1`` (on 2 processes ``accelerate launch --multi_gpu
--num_processes 2``: Accelerate's ``--cpu`` launcher starts one process only; without GPUs
``--multi_gpu`` is its torchrun launcher, gloo on the CPU) and, with only its ``accelerate``
imports renamed to ``accelkit`` in the temporary copy, under
``accelkit launch --cpu --num_processes N``. The network and missing packages are replaced by
the offline stand-ins in ``tests/compat/standins`` (first on ``PYTHONPATH`` for these runs
only). The printed lines (stdout: the metrics, losses
and predictions the scripts print) are compared line by line after masking what legitimately
differs (temporary paths, memory figures, timings); a case passes when both runs exit 0 and
the lines are equal. The results JSON holds pass/fail per case and the first differing line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "standins"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "examples.json"
VENV_BIN = Path(sys.executable).parent

sys.path.insert(0, str(REPO))
from tests.compat._porting import _IMPORT  # noqa: E402
from tests.helpers.distributed import free_port  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    """One example script with its command-line arguments."""

    script: str
    args: tuple[str, ...] = ()
    # Extra regexes (on top of the common ones) whose matches are masked before comparing.
    mask: tuple[str, ...] = ()
    # When set, only the lines matching it are compared (the profiler's timing table is not).
    keep: str | None = None
    processes: tuple[int, ...] = (1, 2)
    # A second launch in the same working folder (a resume from the first one's checkpoint);
    # both launches' lines are compared.
    then: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return " ".join((self.script, *self.args, *(("then", *self.then) if self.then else ())))


_MEMORY = (r"(Memory[^:]*: |Total Peak Memory[^:]*: )[-\d.]+",)
CASES: tuple[Case, ...] = (
    Case("examples/nlp_example.py", ("--cpu",)),
    Case("examples/complete_nlp_example.py", ("--cpu",)),
    Case("examples/complete_nlp_example.py", ("--cpu", "--checkpointing_steps", "epoch")),
    Case("examples/complete_nlp_example.py", ("--cpu", "--with_tracking")),
    Case(
        "examples/complete_nlp_example.py",
        ("--cpu", "--checkpointing_steps", "3", "--use_stateful_dataloader", "--with_tracking"),
    ),
    Case(
        "examples/complete_nlp_example.py",
        ("--cpu", "--checkpointing_steps", "epoch"),
        then=("--cpu", "--resume_from_checkpoint", "epoch_1"),
    ),
    Case(
        "examples/by_feature/checkpointing.py",
        ("--cpu", "--checkpointing_steps", "2"),
        then=("--cpu", "--resume_from_checkpoint", "step_4"),
    ),
    Case("examples/by_feature/automatic_gradient_accumulation.py", ("--cpu",)),
    Case("examples/by_feature/checkpointing.py", ("--cpu", "--checkpointing_steps", "2")),
    Case("examples/by_feature/cross_validation.py", ("--cpu", "--num_folds", "2")),
    Case("examples/by_feature/ddp_comm_hook.py", ("--cpu", "--ddp_comm_hook", "fp16")),
    Case("examples/by_feature/early_stopping.py", ("--cpu",)),
    Case(
        "examples/by_feature/fsdp_with_peak_mem_tracking.py",
        ("--cpu", "--model_name_or_path", "bert-base-cased"),
        mask=_MEMORY,
    ),
    Case(
        "examples/by_feature/gradient_accumulation.py",
        ("--cpu", "--gradient_accumulation_steps", "2"),
    ),
    Case("examples/by_feature/gradient_accumulation_for_autoregressive_models.py", ("--cpu",)),
    Case("examples/by_feature/local_sgd.py", ("--cpu", "--local_sgd_steps", "4")),
    Case("examples/by_feature/memory.py", ("--cpu",)),
    Case("examples/by_feature/multi_process_metrics.py", ("--cpu",)),
    Case("examples/by_feature/profiler.py", ("--cpu",), keep=r"^epoch \d+:"),
    Case("examples/by_feature/tracking.py", ("--cpu", "--with_tracking")),
    Case("examples/config_yaml_templates/run_me.py"),
    Case("examples/cv_example.py", ("--cpu", "--data_dir", "{images}")),
    Case("examples/complete_cv_example.py", ("--cpu", "--data_dir", "{images}")),
    Case(
        "examples/complete_cv_example.py",
        ("--cpu", "--data_dir", "{images}", "--checkpointing_steps", "epoch", "--with_tracking"),
    ),
)
# The CI-sized set, (case, processes), that tests/compat/test_examples.py runs: the cheapest
# representative scripts (nlp_example's training loop, run_me's printed state, LocalSGD's
# averaging, which only acts on 2 processes).
CI_RUNS: tuple[tuple[str, int], ...] = (
    ("examples/nlp_example.py --cpu", 1),
    ("examples/config_yaml_templates/run_me.py", 2),
    ("examples/by_feature/local_sgd.py --cpu --local_sgd_steps 4", 2),
)

SKIPPED: dict[str, str] = {
    "examples/by_feature/deepspeed_with_config_support.py": "DeepSpeed (refused by name)",
    "examples/by_feature/megatron_lm_gpt_pretraining.py": "Megatron-LM (refused by name)",
    "examples/finetune_lm_tpu.py": "TPU/XLA (refused by name in accelkit)",
    "examples/multigpu_remote_launcher.py": "runhouse remote clusters (network; not installed)",
    "examples/by_feature/schedule_free.py": "needs the schedulefree package (not installed)",
}

# Masked in every run: what legitimately differs between two runs or two frameworks.
_COMMON_MASKS = (
    r"/tmp/[^\s'\"]+",  # temporary folders
    r"\d+(?:\.\d+)?\s*(?:s|sec|seconds|ms|it/s|s/it)\b",  # timings
)
# Lines that are noise (progress bars, loader chatter, ClearML's banners with their task ids)
# and not compared at all.
_NOISE = re.compile(r"Loading weights|Writing model shards|it/s\]|s/it\]|^\s*$|ClearML|clearml\.")


def extract(repo: Path, ref: str, target: Path) -> None:
    """``git archive`` ``ref``'s ``examples/`` folder of ``repo`` into ``target``."""
    data = subprocess.run(
        ["git", "-C", str(repo), "archive", ref, "examples"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(target, filter="data")


def default_ref(repo: Path) -> str:
    """The tag of the installed Accelerate version if the repository has it, else HEAD."""
    try:
        from importlib.metadata import version

        tag = "v" + version("accelerate")
    except Exception:
        return "HEAD"
    found = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", tag + "^{commit}"],
        capture_output=True,
    )
    return tag if found.returncode == 0 else "HEAD"


def port_tree(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` with every ``.py`` file's accelerate imports renamed."""
    shutil.copytree(source, target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(_IMPORT.sub(r"\1\2\3accelkit", text))


def _env(hub: Path, home: Path, framework: str, vision: bool, examples: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "ACCELKIT_"))}
    # The timm/torchvision stand-ins only for the CV scripts: transformers imports a torchvision
    # it finds, and the stand-in is not all of it.
    path = [str(STANDINS / "cv"), str(STANDINS)] if vision else [str(STANDINS)]
    if framework == "accelkit":
        path.append(str(REPO))
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        HF_HOME=str(home / "hf_home"),
        HF_HUB_CACHE=str(hub),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        COMET_ERROR_TRACKING_ENABLE="false",
        COMET_AUTO_LOG_ENV_DETAILS="false",
        COMET_START_ONLINE="false",  # no API key: the scripts' log_with="all" starts Comet
        COMET_OFFLINE_DIRECTORY=str(home / "comet"),
        MLFLOW_DISABLE_TELEMETRY="true",
        DVC_NO_ANALYTICS="1",  # dvclive installed: "all" starts it; no DVC Studio either
        DVC_STUDIO_OFFLINE="true",
        # clearml installed: log_with="all" starts it (Accelerate's and ours), offline here
        CLEARML_OFFLINE_MODE="1",
        CLEARML_CACHE_DIR=str(home / "clearml"),
        PYTHONHASHSEED="0",
        ACCELKIT_EXAMPLES_TAG_RANKS=str(examples.parent),
        OMP_NUM_THREADS="1",
        ACCELKIT_STANDIN_ROWS=os.environ.get("ACCELKIT_STANDIN_ROWS", "64"),
    )
    return env


_RANK_TAG = re.compile(r"^\[rank (\d+)\] (.*)$")


def normalise(text: str, masks: tuple[str, ...], keep: str | None = None) -> list[str]:
    """The scripts' comparable lines, rank 0's first, then rank 1's (each in its order).

    Only lines a script printed count (``standins/sitecustomize.py`` tags them with the rank;
    the launchers' own lines are left out); noise is dropped and what legitimately differs is
    masked.
    """
    tagged = [m.groups() for m in map(_RANK_TAG.match, text.splitlines()) if m]
    lines = []
    for rank, line in sorted(tagged, key=lambda t: int(t[0])):  # stable: keeps each rank's order
        if _NOISE.search(line) or (keep is not None and not re.search(keep, line)):
            continue
        line = f"[rank {rank}] {line}"
        for pattern in (*_COMMON_MASKS, *masks):
            line = re.sub(pattern, lambda m: (m.group(1) if m.lastindex else "") + "<masked>", line)
        lines.append(line.rstrip())
    return lines


def run_one(
    framework: str, examples: Path, case: Case, processes: int, hub: Path, timeout: float
) -> dict[str, object]:
    """Launch one case under one framework in a fresh working folder."""
    launcher = (
        [str(VENV_BIN / "accelerate")]
        if framework == "accelerate"
        else [sys.executable, "-m", "accelkit.cli.main"]
    )
    script = examples / Path(case.script).relative_to("examples")
    args = [a.replace("{images}", str(hub.parent / "images")) for a in case.args]
    with tempfile.TemporaryDirectory(prefix=f"ex-{framework}-") as work:
        if framework == "accelerate" and processes > 1:
            # ``accelerate launch --cpu`` always runs one process (its simple launcher); its
            # multi-CPU run is the torchrun launcher, which ``--multi_gpu`` picks on a machine
            # without GPUs (Accelerate then reports MULTI_CPU and uses gloo).
            # ``ACCELERATE_USE_CPU`` is what its ``--cpu`` sets for the script (Accelerator()
            # without cpu=True then also runs on the CPU, as under accelkit's --cpu).
            device = ["--multi_gpu", "--main_process_port", str(free_port())]
        else:
            device = ["--cpu"]
        start = time.monotonic()
        rc, out, err = 0, "", ""
        for launch_args in (args, list(case.then)) if case.then else (args,):
            # A fresh port for each launch (the reference's torchrun rendezvous).
            if "--main_process_port" in device:
                device[-1] = str(free_port())
            cmd = [*launcher, "launch", *device, "--num_processes", str(processes)]
            try:
                proc = subprocess.run(
                    [*cmd, str(script), *launch_args],
                    cwd=work,
                    env={
                        **_env(hub, Path(work), framework, "{images}" in case.args, examples),
                        "ACCELERATE_USE_CPU": "True",
                    },
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                rc, out, err = proc.returncode, out + proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc = -1
                partial = exc.stdout or ""
                out += partial.decode() if isinstance(partial, bytes) else partial
                err = f"timed out after {timeout} s"
            if rc != 0:
                break
        return {
            "rc": rc,
            "stdout": out,
            "stderr_tail": err[-6000:],
            "seconds": round(time.monotonic() - start, 1),
        }


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .*)$")


def _last_error(run: dict[str, object]) -> str:
    """The last ``SomeError: message`` line of a run's stderr, without torchrun's rank prefix."""
    found = [m.group(1) for m in map(_ERROR_LINE.match, str(run["stderr_tail"]).splitlines()) if m]
    return found[-1] if found else f"exit status {run['rc']}"


def compare(case: Case, ref: dict[str, object], ours: dict[str, object]) -> dict[str, object]:
    """Pass/fail of one case, with the first differing line."""
    a = normalise(str(ref["stdout"]), case.mask, case.keep)
    b = normalise(str(ours["stdout"]), case.mask, case.keep)
    result: dict[str, object] = {"lines_compared": len(a)}
    if ref["rc"] != 0 and ours["rc"] != 0:
        theirs_error, our_error = _last_error(ref), _last_error(ours)
        result.update(
            passed=False,
            why="both runs failed"
            + (" with the same error" if theirs_error == our_error else " with different errors"),
            errors={"accelerate": theirs_error, "accelkit": our_error},
            error=ref["stderr_tail"],
        )
    elif ref["rc"] != 0:
        result.update(
            passed=False, why=f"accelerate run failed (rc {ref['rc']})", error=ref["stderr_tail"]
        )
    elif ours["rc"] != 0:
        result.update(
            passed=False, why=f"accelkit run failed (rc {ours['rc']})", error=ours["stderr_tail"]
        )
    elif a == b:
        result.update(passed=True)
    else:
        index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        result.update(
            passed=False,
            why="printed lines differ"
            + (" (same lines, another order)" if sorted(a) == sorted(b) else ""),
            first_difference={
                "line": index + 1,
                "accelerate": a[index] if index < len(a) else "<end of output>",
                "accelkit": b[index] if index < len(b) else "<end of output>",
            },
        )
    if result["passed"] and not a:
        result.update(passed=False, why="nothing printed to compare")
    return result


def select(only: list[str] | None) -> list[Case]:
    if not only:
        return list(CASES)
    return [c for c in CASES if any(o in c.name or o == c.name for o in only)]


@dataclasses.dataclass(frozen=True)
class Workspace:
    """The extracted and ported examples, the stand-in hub cache and image folder."""

    reference: Path
    ported: Path
    hub: Path


def prepare(repo: Path, ref: str, root: Path) -> Workspace:
    """Extract ``ref``'s examples into ``root``, port a copy, build the stand-ins' data."""
    extract(repo, ref, root / "reference")
    port_tree(root / "reference" / "examples", root / "ported" / "examples")
    hub = root / "hub"
    for builder, target in (("standin_hub.py", hub), ("standin_images.py", root / "images")):
        subprocess.run(
            [sys.executable, str(STANDINS / builder), str(target)], check=True, capture_output=True
        )
    return Workspace(root / "reference" / "examples", root / "ported" / "examples", hub)


def run_case(
    case: Case, processes: int, ws: Workspace, timeout: float = 600, keep_output: bool = False
) -> dict[str, object]:
    """Run ``case`` on ``processes`` processes under both frameworks and compare them."""
    ref_run = run_one("accelerate", ws.reference, case, processes, ws.hub, timeout)
    our_run = run_one("accelkit", ws.ported, case, processes, ws.hub, timeout)
    entry: dict[str, object] = {
        "case": case.name,
        "script": case.script,
        "args": list(case.args),
        "processes": processes,
    }
    entry.update(compare(case, ref_run, our_run))
    entry["seconds"] = {"accelerate": ref_run["seconds"], "accelkit": our_run["seconds"]}
    if keep_output or not entry["passed"]:
        entry["output"] = {
            "accelerate": normalise(str(ref_run["stdout"]), case.mask, case.keep)[-40:],
            "accelkit": normalise(str(our_run["stdout"]), case.mask, case.keep)[-40:],
        }
    return entry


def commit_of(repo: Path, ref: str) -> str:
    """The commit ``ref`` names in ``repo``."""
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", ref + "^{commit}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def run_matrix(
    repo: Path,
    ref: str | None = None,
    only: list[str] | None = None,
    processes: tuple[int, ...] = (1, 2),
    timeout: float = 600,
    keep_output: bool = False,
    log: bool = True,
    progress: Callable[[list[dict[str, object]]], None] | None = None,
) -> dict[str, object]:
    """Run the selected cases; returns the results document (see the module docstring)."""
    ref = ref or default_ref(repo)
    commit = commit_of(repo, ref)
    results = []
    with tempfile.TemporaryDirectory(prefix="accelkit-examples-") as tmp:
        ws = prepare(repo, ref, Path(tmp))
        for case in select(only):
            for n in processes:
                if n not in case.processes:
                    continue
                entry = run_case(case, n, ws, timeout, keep_output)
                results.append(entry)
                if log:
                    state = "PASS" if entry["passed"] else "FAIL " + str(entry.get("why"))
                    print(f"[{n} proc] {case.name}: {state}", flush=True)
                if progress is not None:
                    progress(results)
    import accelerate
    import torch

    passed = sum(1 for r in results if r["passed"])
    return {
        "accelerate_repo_ref": ref,
        "accelerate_repo_commit": commit,
        "accelerate_installed": accelerate.__version__,
        "torch": torch.__version__,
        "standin_rows": int(os.environ.get("ACCELKIT_STANDIN_ROWS", "64")),
        "passed": passed,
        "total": len(results),
        "skipped": SKIPPED,
        "results": results,
    }


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old``'s results with those ``new`` reran replaced (and new ones appended)."""
    fresh = {(r["case"], r["processes"]): r for r in new["results"]}
    current = {c.name for c in CASES}  # results of cases since renamed are dropped
    kept = [
        fresh.pop((r["case"], r["processes"]), r) for r in old["results"] if r["case"] in current
    ]
    results = kept + list(fresh.values())
    order = {c.name: i for i, c in enumerate(CASES)}
    results.sort(key=lambda r: (order[r["case"]], r["processes"]))
    return {
        **new,
        "results": results,
        "passed": sum(1 for r in results if r["passed"]),
        "total": len(results),
    }


def table(doc: dict[str, object]) -> str:
    """The results as a markdown table (one row per case, a column per process count)."""
    rows: dict[str, dict[int, str]] = {}
    for r in doc["results"]:  # type: ignore[attr-defined]
        if r["passed"]:
            cell = "pass"
        elif str(r["why"]).startswith("both runs failed"):
            cell = "fails under Accelerate too"
        else:
            cell = "FAIL: " + str(r["why"])
        rows.setdefault(str(r["case"]), {})[int(r["processes"])] = cell
    counts = sorted({n for cells in rows.values() for n in cells})
    head = "| script and arguments | " + " | ".join(
        f"{n} process{'es' if n > 1 else ''}" for n in counts
    )
    lines = [head + " |", "|---|" + "---|" * len(counts)]
    for name, cells in rows.items():
        shown = name.removeprefix("examples/").replace("{images}", "IMAGES")
        lines.append(f"| `{shown}` | " + " | ".join(cells.get(n, "-") for n in counts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--accelerate-repo", type=Path, default=os.environ.get("ACCELKIT_ACCELERATE_REPO")
    )
    parser.add_argument(
        "--ref", default=None, help="git ref (default: v<installed version> if tagged, else HEAD)"
    )
    parser.add_argument("--only", nargs="*", help="run the cases whose name contains one of these")
    parser.add_argument("--processes", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--keep-output", action="store_true", help="store every run's compared lines"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the runs made now in an existing --out file",
    )
    parser.add_argument(
        "--table", type=Path, help="print the results file's markdown table and stop (no runs)"
    )
    args = parser.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.accelerate_repo is None:
        parser.error(
            "no Accelerate checkout: pass --accelerate-repo PATH or set ACCELKIT_ACCELERATE_REPO "
            "(the examples are only in Accelerate's git repository, not in its packages)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial.json")

    def progress(results: list[dict[str, object]]) -> None:
        partial.write_text(json.dumps(results, indent=2) + "\n")

    doc = run_matrix(
        args.accelerate_repo,
        args.ref,
        args.only,
        tuple(args.processes),
        args.timeout,
        args.keep_output,
        progress=progress,
    )
    partial.unlink(missing_ok=True)
    if args.merge and args.out.exists():
        doc = merge(json.loads(args.out.read_text()), doc)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{doc['passed']}/{doc['total']} passed; results in {args.out}")
    return 0 if doc["passed"] == doc["total"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
