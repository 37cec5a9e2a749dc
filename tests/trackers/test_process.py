"""Whole-interpreter behaviour: lazy SDK imports, draining at exit, never hanging at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from accelkit.trackers.backends.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[2]

# One interpreter (they are slow to start on a busy machine) for three checks:
# 1. building trackers for every backend imports no SDK;
# 2. without end_training(), interpreter exit still writes all 50 lines of a slow tracker;
# 3. a tracker hung in log() is left behind at exit with a warning instead of hanging it.
SCRIPT = """
import sys, threading, time
from accelkit import Accelerator, GeneralTracker
from accelkit.trackers import TrackerHub
from accelkit.trackers.backends.jsonl import JSONLTracker

TrackerHub.create(["tensorboard", "wandb", "comet_ml", "mlflow", "jsonl"], logging_dir=LOGDIR)
sdks = ("wandb", "mlflow", "comet_ml", "tensorboard", "torch.utils.tensorboard")
print("SDKS", sorted(name for name in sdks if name in sys.modules))

class SlowJsonl(JSONLTracker):
    name = "slow_jsonl"
    def log(self, values, step=None, **kwargs):
        time.sleep(0.005)
        super().log(values, step, **kwargs)

class Hung(GeneralTracker):
    name = "hung"
    def log(self, values, step=None, **kwargs):
        threading.Event().wait()

accelerator = Accelerator(log_with=[SlowJsonl("run", LOGDIR), Hung()])
accelerator.init_trackers("run")
for step in range(50):
    accelerator.log({"step_value": step}, step=step)
print("logged", flush=True)
"""


def test_lazy_sdks_and_draining_and_not_hanging_at_exit(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"LOGDIR = {str(tmp_path)!r}\n" + textwrap.dedent(SCRIPT)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ACCELKIT_TRACKER_TIMEOUT": "5"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "SDKS []" in result.stdout and "logged" in result.stdout
    records = read_jsonl(str(tmp_path / "run"))
    assert [r["step"] for r in records] == list(range(50))
    assert [r["values"]["step_value"] for r in records] == list(range(50))
    assert "Tracker 'hung' did not finish within 5 s (busy in log()" in result.stderr


WANDB_SCRIPT = """
from accelkit import Accelerator
accelerator = Accelerator(cpu=True, log_with=["wandb"], project_dir=LOGDIR)
accelerator.init_trackers("run", init_kwargs={"wandb": {"dir": LOGDIR}})
for step in range(5):
    accelerator.log({"x": float(step)}, step=step)
accelerator._trackers.flush()  # wandb's run is open (it starts at first use, in the background)
print("logged", flush=True)
"""


def test_a_run_that_never_calls_end_training_finishes_wandb_before_wandb_exits(
    tmp_path: Path,
) -> None:
    """wandb registers its own exit hook in ``wandb.init()``, which accelkit calls on a worker
    thread after its own hook was registered: unless accelkit's hook is moved behind it, wandb's
    service is gone when accelkit finishes the run ("failed in finish(): ConnectionResetError:
    Connection lost")."""
    from tests.trackers.conftest import OFFLINE_ENV
    from tests.trackers.readers import read_wandb

    result = subprocess.run(
        [sys.executable, "-c", f"LOGDIR = {str(tmp_path)!r}\n" + textwrap.dedent(WANDB_SCRIPT)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "logged" in result.stdout
    assert "failed in finish()" not in result.stderr, result.stderr
    scalars, _ = read_wandb(str(tmp_path), "run")
    assert scalars["x"] == [(step, float(step)) for step in range(5)]
