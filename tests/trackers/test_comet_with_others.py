"""Comet beside TensorBoard and wandb records each value once (its auto-logging is off).

Comet's auto-logging patches TensorBoard's writer only when comet_ml is imported before
tensorboard, which the test session has already done otherwise; so the run is a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.trackers import readers

SCRIPT = textwrap.dedent(
    """
    import sys
    from accelkit import Accelerator

    acc = Accelerator(cpu=True, log_with=["comet_ml", "tensorboard", "wandb"],
                      project_dir=sys.argv[1])
    acc.init_trackers("dup")
    for step in (1, 2, 3):
        acc.log({"loss": step / 2}, step=step)
    acc.end_training()
    """
)


def test_comet_records_each_step_once_beside_tensorboard_and_wandb(workdir: Path) -> None:
    subprocess.run(
        [sys.executable, "-c", SCRIPT, str(workdir)],
        check=True,
        # The suite disables Comet's auto-logging globally; a user's run does not.
        env={k: v for k, v in os.environ.items() if k != "COMET_DISABLE_AUTO_LOGGING"},
        cwd=workdir,
        timeout=120,
    )
    scalars, _ = readers.read_comet(str(workdir), "dup")
    assert scalars["loss"] == [(1, 0.5), (2, 1.0), (3, 1.5)]
