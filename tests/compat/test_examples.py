"""Accelerate's example scripts run unchanged on accelkit and print what they print on Accelerate.

The scripts are not in Accelerate's packages (neither the wheel nor the sdist on PyPI holds
``examples/``) and CI cannot fetch Accelerate's git repository, so these tests run only when
``ACCELKIT_ACCELERATE_REPO`` names an Accelerate checkout or git snapshot; otherwise they skip
saying so. Nothing of Accelerate's is copied into this repository: the runner
(``tests/compat/examples_matrix.py``) extracts the scripts into a temporary folder, runs each
as-is under ``accelerate launch`` and, imports renamed, under ``accelkit launch`` with the same
seed and the offline stand-ins of ``tests/compat/standins``, and compares the printed lines.
This is the CI-sized set (the cheapest representative scripts); the full matrix is the runner's
command line, whose last results are ``tests/compat/results/examples.json``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compat import examples_matrix as matrix

REPO_ENV = "ACCELKIT_ACCELERATE_REPO"
ACCELERATE_REPO = os.environ.get(REPO_ENV)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not ACCELERATE_REPO,
        reason=(
            f"{REPO_ENV} is not set: Accelerate's example scripts are only in its git repository "
            "(not in its PyPI packages) and CI cannot fetch it; point the variable at a checkout "
            "or snapshot to run them"
        ),
    ),
]

CASES = {case.name: case for case in matrix.CASES}
CI_RUNS = matrix.CI_RUNS


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[matrix.Workspace]:
    repo = Path(str(ACCELERATE_REPO))
    yield matrix.prepare(repo, matrix.default_ref(repo), tmp_path_factory.mktemp("examples"))


@pytest.mark.parametrize(
    ("name", "processes"), CI_RUNS, ids=[f"{n.split('/')[-1]}-{p}" for n, p in CI_RUNS]
)
def test_example_prints_what_accelerate_prints(
    workspace: matrix.Workspace, name: str, processes: int
) -> None:
    result = matrix.run_case(CASES[name], processes, workspace, timeout=300)
    assert result["passed"], result
    # Something was compared: the metrics lines the script prints.
    assert int(str(result["lines_compared"])) > 0


def test_runner_sees_a_divergence(workspace: matrix.Workspace, tmp_path: Path) -> None:
    """The comparison is not vacuous: a ported copy that trains differently fails it."""
    diverged = tmp_path / "examples"
    shutil.copytree(workspace.ported, diverged)
    script = diverged / "nlp_example.py"
    text = script.read_text()
    assert '"lr": 2e-5' in text
    script.write_text(text.replace('"lr": 2e-5', '"lr": 2e-2'))
    changed = matrix.Workspace(workspace.reference, diverged, workspace.hub)
    result = matrix.run_case(CASES["examples/nlp_example.py --cpu"], 1, changed, timeout=300)
    assert not result["passed"]
    assert result["why"] == "printed lines differ"
