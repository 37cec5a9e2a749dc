"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.s3 import s3_server, s3_url

__all__ = ["s3_server", "s3_url"]


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run every test not marked ``cuda`` on the CPU, also on a machine with a GPU.

    The tests feed CPU tensors, compare with CPU arithmetic and start CPU worker processes
    (which inherit the variable); the ``cuda`` tests cover the GPU paths. Without this, a GPU
    machine moves every prepared model to the GPU and those comparisons fail for the wrong
    reason.
    """
    if request.node.get_closest_marker("cuda") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACCELKIT_USE_CPU", "1")
        yield


# The fast tier (`pytest -m "not slow"`, CONTRIBUTING.md) leaves out every test of these folders
# (real multi-process jobs, servers, kill trials, Accelerate's own scripts) and these files (each
# starts launchers, tracker servers or whole training jobs), besides tests marked slow by hand.
_SLOW_FOLDERS = ("distributed", "reliability", "compat", "examples")
_SLOW_FILES = {
    "cli/test_launch.py",
    "cli/test_launch_signals.py",
    "checkpointing/test_accelerate_import.py",
    "trackers/test_continuity_wandb_comet.py",
    "trackers/test_continuity_mlflow.py",
    "trackers/test_continuity_files.py",
    "test_readme_snippets.py",
    "trackers/test_accelerate_compat.py",
    "trackers/test_process.py",
    "trackers/test_distributed.py",
    "trackers/test_comet_with_others.py",
    "checkpointing/test_acceptance.py",
    "testing/test_contracts.py",
}
_TESTS = Path(__file__).resolve().parent


# The longest modules, in worker-seconds on the 2-core machine (a junit profile of the whole
# suite, `--junitxml`, summed per module; taken at load ~5, so about 1.5x a quiet run's; the
# two modules added after it, test_resume_matrix and test_fork_backends, estimated; those made
# faster since, scaled by their own before/after: test_doc_snippets, test_resume_process_count,
# test_journal_mlflow, test_custom_tracker, test_hostile_config; compat/test_memory, now
# seconds, left the table).
# `--dist loadscope` hands modules (a test class is a unit of its own) to the workers in
# collection order (pyproject's addopts turn off xdist's own reorder, by number of tests):
# these go first, longest first, so that the run does not end with one long module on one
# worker while the other worker idles. The figures only rank them: a stale one costs some
# idle time at the end, never a test.
LONG_MODULES = {
    "compat/test_same_results.py": 214,
    "compat/test_accelerate_scripts.py": 210,
    "cli/test_launch_watchdog.py": 207,
    "trackers/test_journal_mlflow.py": 175,
    "checkpointing/test_accelerate_import.py": 172,
    "reliability/test_hostile_launch.py": 164,
    "trackers/test_continuity_wandb_comet.py": 162,
    "distributed/test_exit.py": 159,
    "cli/test_launch_preemption.py": 155,
    "test_resume_matrix.py": 150,
    "checkpointing/test_async.py": 122,
    "trackers/test_fork_backends.py": 120,
    "trackers/test_continuity_mlflow.py": 115,
    "reliability/test_redteam.py": 106,
    "cli/test_launch.py": 106,
    "cli/test_launch_signals.py": 104,
    "test_resume_process_count.py": 95,
    "cli/test_launch_restarts.py": 90,
    "checkpointing/test_replication.py": 89,
    "examples/test_slurm.py": 88,
    "distributed/test_multinode.py": 85,
    "test_doc_snippets.py": 77,
    "examples/test_boilerplate.py": 73,
    "reliability/test_hostile_config.py": 70,
    "reliability/test_hostile_tracker_files.py": 68,
    "reliability/test_crash.py": 65,
    "distributed/test_preemption.py": 62,
    "cli/test_ckpt.py": 59,
    "examples/test_custom_tracker.py": 51,
}


def longest_first(
    items: list[pytest.Item], root: Path, seconds: dict[str, float]
) -> list[pytest.Item]:
    """``items`` with those of the modules in ``seconds`` (paths relative to ``root``) first,
    longest first; the order within a module, and of the other modules, is kept."""
    ranked = sorted(seconds, key=lambda module: -seconds[module])
    rank = {(root / module).resolve(): place for place, module in enumerate(ranked)}
    return sorted(items, key=lambda item: rank.get(item.path.resolve(), len(rank)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = item.path.resolve().relative_to(_TESTS).as_posix()
        if relative.split("/", 1)[0] in _SLOW_FOLDERS or relative in _SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    items[:] = longest_first(items, _TESTS, LONG_MODULES)


def _accelerate_template(tmp_path_factory: pytest.TempPathFactory, processes: int) -> Path:
    from filelock import FileLock

    from tests.checkpointing.accelerate_helpers import run_script

    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = folder / f"accelerate-template-{processes}" / "checkpoint_0"
    with FileLock(f"{path.parent}.lock"):
        if not path.exists():
            building = folder / f"accelerate-template-{processes}.building"
            shutil.rmtree(building, ignore_errors=True)
            run_script("accelerate", [building / "checkpoint_0"], building / "out", processes)
            building.replace(path.parent)
    return path


@pytest.fixture(scope="session")
def accelerate_checkpoint_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``checkpoint_0`` written by Hugging Face accelerate's ``save_state`` (1 process,
    fp32: tests/checkpointing/accelerate_run.py), to copy (``accelerate_checkpoint``), beside
    ``out/``, what the run wrote (``results``). A run of it costs ~7 CPU-s, which five modules
    paid each. Made once a session: under xdist the workers share it, the first one to need it
    builds it under a lock in the session's folder.
    """
    return _accelerate_template(tmp_path_factory, 1)


@pytest.fixture(scope="session")
def accelerate_checkpoint_template_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``accelerate_checkpoint_template`` written by 2 processes (``torch.distributed.run``)."""
    return _accelerate_template(tmp_path_factory, 2)


#: The most workers ``-n auto`` starts: each may run a multi-process job and its own servers
#: (SeaweedFS, MLflow), so more than this costs memory without making the suite faster.
_MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core, at most ``_MAX_WORKERS``;
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides, as it does in pytest-xdist itself."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if given:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, _MAX_WORKERS))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--async-writer",
        choices=("process", "thread"),
        default=None,
        help="make every ProjectConfiguration left at async_writer='auto' use this writer "
        "instead (e.g. `pytest -m cuda --async-writer process` runs the GPU tests on the writer "
        "process, which 'auto' leaves GPU state without); tests of the default itself then fail",
    )


@pytest.fixture(autouse=True, scope="session")
def _async_writer_option(request: pytest.FixtureRequest) -> Iterator[None]:
    writer = request.config.getoption("--async-writer")
    if writer is None:
        yield
        return
    from accelkit.checkpointing.config import ProjectConfiguration

    post_init = ProjectConfiguration.__post_init__

    def forced(self: ProjectConfiguration) -> None:
        if self.async_writer == "auto":
            self.async_writer = writer
        post_init(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProjectConfiguration, "__post_init__", forced)
        yield
