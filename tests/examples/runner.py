"""Run an example the way the README says: through the real `accelkit` CLI, in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import setup_race

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Keep every hosted tracker service on this machine, whatever the example does.
OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "COMET_ERROR_TRACKING_ENABLE": "false",
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DVC_STUDIO_OFFLINE": "true",
    "AWS_EC2_METADATA_DISABLED": "true",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "CLEARML_OFFLINE_MODE": "1",
    "PYTHONUNBUFFERED": "1",
}


def accelkit_command() -> list[str]:
    """The ``accelkit`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "accelkit"
    if script.exists():
        return [str(script)]
    found = shutil.which("accelkit")
    return [found] if found else [sys.executable, "-m", "accelkit.cli.main"]


def run(
    args: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    expect: int = 0,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """Run a command, failing the test with its output if the exit code is not ``expect``."""
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    for _attempt in range(2):
        result = subprocess.run(
            list(args),
            cwd=cwd,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        # A job that lost a race with another program while it set up (its rendezvous port
        # taken, a gloo connection cut) proves nothing: only that is run once more.
        if result.returncode == expect or setup_race(result.stdout + result.stderr) is None:
            break
    if result.returncode != expect:
        pytest.fail(
            f"{' '.join(args)} exited {result.returncode} (expected {expect})\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result


def launch(
    script: str, *script_args: str, processes: int = 2, cwd: Path, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``accelkit launch --cpu --num_processes N examples/<script> ARGS``."""
    return run(
        [
            *accelkit_command(),
            "launch",
            "--cpu",
            "--num_processes",
            str(processes),
            str(EXAMPLES / script),
            *script_args,
        ],
        cwd=cwd,
        **kwargs,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
