"""`accelkit env` and the cheap CLI commands: right answers without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelkit.cli.env import environment_report, nvidia_driver, torch_build

ROOT = Path(__file__).resolve().parents[2]

# Modules that take from a tenth of a second to seconds to import; a command that only prints
# help or versions needs none of them.
HEAVY = (
    "torch",
    "torch.distributed",
    "numpy",
    "safetensors",
    "tensorboard",
    "wandb",
    "mlflow",
    "comet_ml",
    "s3fs",
    "accelkit.accelerator",
)

# Runs the console script's code in a fresh interpreter, then reports which heavy modules it
# imported and how it exited (last line of stdout, after the command's own output).
_PROBE = """
import json, runpy, sys
watched = json.loads(sys.argv[2])
sys.argv = ["accelkit", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("accelkit.cli.main", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
heavy = [name for name in watched if name in sys.modules]
print("\\n" + json.dumps({"code": code, "heavy": heavy}))
"""


def _probe(argv: list[str]) -> tuple[int, list[str], str]:
    """Exit code, heavy modules imported, and output of ``accelkit ARGV`` in a fresh process."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    *output, last = proc.stdout.rstrip("\n").split("\n")
    result = json.loads(last)
    return int(result["code"] or 0), list(result["heavy"]), "\n".join(output)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], "usage: accelkit"),
        (["env"], "CUDA available"),
        (["ckpt", "--help"], "usage: accelkit ckpt"),
        (["ckpt", "ls", "--help"], "usage: accelkit ckpt ls"),
        (["ckpt", "verify", "--help"], "usage: accelkit ckpt verify"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_cheap_commands_import_no_heavy_module(argv: list[str], expected: str) -> None:
    code, heavy, output = _probe(argv)
    assert code == 0 and expected in output, output  # the command really ran
    assert heavy == [], f"`accelkit {' '.join(argv)}` imported {heavy}"


@pytest.fixture(scope="module")
def saved_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder with one committed checkpoint and a jsonl tracker journal."""
    import torch

    from accelkit import Accelerator
    from accelkit.utils import ProjectConfiguration

    project = tmp_path_factory.mktemp("cheap") / "project"
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config, log_with="jsonl")
    accelerator.init_trackers("run")
    accelerator.prepare(torch.nn.Linear(4, 4))
    accelerator.log({"loss": torch.tensor(0.5)}, step=0)
    accelerator.save_state()
    accelerator.end_training()
    return project


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["ckpt", "ls", "{project}"], "checkpoint_0"),
        (["ckpt", "verify", "{project}"], "checkpoint_0"),
        (["ckpt", "inspect", "{project}/checkpoints/checkpoint_0"], "model.safetensors"),
        (["track", "status", "{project}"], "delivered, 0 pending"),
        (["track", "sync", "{project}"], "0 pending"),
    ],
    ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else None,
)
def test_commands_that_read_a_project_import_no_heavy_module(
    saved_project: Path, argv: list[str], expected: str
) -> None:
    """Listing, verifying and inspecting checkpoints and reading the trackers' journals need
    neither torch nor numpy: each answers in a fraction of a second, not torch's 1-2 s import
    (for a folder that Accelerate wrote, `ckpt ls` reads its optimizer steps with torch)."""
    code, heavy, output = _probe([a.format(project=saved_project) for a in argv])
    assert code == 0 and expected in output, output
    assert heavy == [], f"`accelkit {' '.join(argv)}` imported {heavy}"


def test_torch_build_is_read_without_importing_torch() -> None:
    torch = pytest.importorskip("torch")
    build = torch_build()
    assert build == {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "xpu": getattr(torch.version, "xpu", None),
    }


def test_env_cuda_line_agrees_with_torch() -> None:
    torch = pytest.importorskip("torch")
    fast = environment_report()
    checked = environment_report(check_torch=True)
    assert checked["CUDA available"] == str(torch.cuda.is_available())
    if torch.version.cuda is None and torch.version.hip is None:
        assert fast["CUDA available"] == "False (CPU-only torch build)"
        assert fast["torch built for"] == "CPU only"
    else:  # a GPU build: only torch can say whether it sees a device
        assert fast["CUDA available"].startswith("not checked")
        assert (torch.version.cuda or torch.version.hip) in fast["torch built for"]
    if torch.distributed.is_available() and torch.distributed.is_gloo_available():
        assert "gloo" in checked["torch.distributed backends"]
    assert fast["torch"] == checked["torch"]


@pytest.mark.slow
def test_env_torch_flag_through_the_cli() -> None:
    code, heavy, output = _probe(["env", "--torch"])
    assert code == 0
    assert "torch" in heavy  # --torch is the opt-in to the slow path
    assert "torch.distributed backends" in output


def test_nvidia_driver_from_its_files(tmp_path: Path) -> None:
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    assert nvidia_driver(str(sys_root), str(proc_root)) == (None, [])  # no driver loaded

    nvrm = proc_root / "driver" / "nvidia" / "version"
    nvrm.parent.mkdir(parents=True)
    nvrm.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 22:15:33 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    for bus, model in (("0000:00:05.0", "NVIDIA H100 80GB HBM3"), ("0000:00:04.0", "Tesla T4")):
        info = proc_root / "driver" / "nvidia" / "gpus" / bus / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t {model}\nIRQ:   \t\t 35\nBus Type: \t PCIe\n")
    # Without /sys/module/nvidia/version the NVRM line gives the version; GPUs in bus order.
    assert nvidia_driver(str(sys_root), str(proc_root)) == (
        "550.54.15",
        ["Tesla T4", "NVIDIA H100 80GB HBM3"],
    )
    module = sys_root / "module" / "nvidia" / "version"
    module.parent.mkdir(parents=True)
    module.write_text("535.104.05\n")
    assert nvidia_driver(str(sys_root), str(proc_root))[0] == "535.104.05"
