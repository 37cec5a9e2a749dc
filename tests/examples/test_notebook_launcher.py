"""examples/notebook_launcher.py: 2 worker processes started from a plain Python session."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.examples.runner import EXAMPLES, run


def test_notebook_launcher_example_runs_two_processes(tmp_path: Path) -> None:
    result = run(
        [sys.executable, str(EXAMPLES / "notebook_launcher.py"), "--epochs", "2"], cwd=tmp_path
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    # Printed once per epoch (not once per process); gather_for_metrics counts every sample
    # exactly once although the processes' shares were padded to equal length.
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"]
    assert all("over 500 samples on 2 processes" in line for line in lines)
