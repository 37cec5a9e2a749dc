"""The hang watchdog's parts in one process (``accelkit.runtime.watchdog``): its setting, a stall
that ends the process with the requeue code and a stack file, and progress or ``not_a_hang()``
that never do. The real multi-process jobs are in ``tests/cli/test_launch_watchdog.py``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator
from accelkit.errors import ConfigurationError
from accelkit.runtime.watchdog import HangReport, Watchdog, check_hang_timeout, stack_file
from tests.helpers.distributed import run_distributed


@pytest.mark.parametrize("value", [0, -1, "10", True, float("nan")])
def test_a_bad_timeout_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ConfigurationError, match="hang_timeout_seconds=") as caught:
        check_hang_timeout(value)
    assert "hang_timeout_seconds=600" in str(caught.value)  # the fix


def test_the_accelerator_refuses_a_bad_timeout(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="hang_timeout_seconds=-5"):
        Accelerator(project_dir=str(tmp_path), hang_timeout_seconds=-5)


class _Exit:
    def __init__(self) -> None:
        self.code: int | None = None
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.code = code
        self.done.set()


def _watchdog(
    tmp_path: Path, exit: _Exit, reports: list[HangReport], timeout: float = 0.3
) -> Watchdog:
    return Watchdog(
        timeout,
        rank=0,
        world_size=1,
        stack_folder=str(tmp_path / "hangs"),
        on_hang=reports.append,
        exit=exit,
    )


def test_a_stall_writes_the_stacks_reports_and_exits_75(tmp_path: Path) -> None:
    exit, reports = _Exit(), []
    watchdog = _watchdog(tmp_path, exit, reports)
    watchdog.start()
    watchdog.beat()  # the first step boundary starts the clock; then nothing moves
    assert exit.done.wait(30)
    assert exit.code == 75
    [report] = reports
    assert report.stack_file == stack_file(str(tmp_path / "hangs"), 0)
    text = Path(report.stack_file).read_text()
    assert text.startswith("accelkit watchdog: rank 0")
    assert "no step progress" in text
    # faulthandler's dump of every thread, this test's own among them.
    assert "test_a_stall_writes_the_stacks_reports_and_exits_75" in text


def test_progress_and_not_a_hang_are_never_a_hang(tmp_path: Path) -> None:
    exit, reports = _Exit(), []
    watchdog = _watchdog(tmp_path, exit, reports, timeout=1.0)
    watchdog.start()
    try:
        # Steps of 0.1 s under a 1 s timeout for 20 steps, then 2.5 s inside not_a_hang().
        for _ in range(20):
            watchdog.beat()
            time.sleep(0.1)
        with watchdog.not_a_hang():
            time.sleep(2.5)
        watchdog.beat()
    finally:
        watchdog.close()
    assert exit.code is None and not reports
    assert not (tmp_path / "hangs").exists()


def test_before_the_first_step_the_clock_does_not_run(tmp_path: Path) -> None:
    exit, reports = _Exit(), []
    watchdog = _watchdog(tmp_path, exit, reports)
    watchdog.start()
    try:
        time.sleep(1.0)  # loading a model, preparing data: no step boundary yet
    finally:
        watchdog.close()
    assert exit.code is None and not reports


@pytest.mark.parametrize("rank1", ["moving", "saving"])
def test_a_hang_seen_by_one_rank_makes_a_moving_rank_write_its_stacks(
    tmp_path: Path, rank1: str
) -> None:
    # Two watchdogs on one store (the process group's, in a real job): rank 0 stops, rank 1
    # keeps moving (or waits inside a save, whose clock is stopped), and still writes its
    # stacks and exits when rank 0 reports the hang.
    import contextlib

    import torch.distributed as dist

    store = dist.HashStore()
    exits = [_Exit(), _Exit()]
    reports: list[list[HangReport]] = [[], []]
    dogs = [
        Watchdog(
            0.5 if rank == 0 else 3600,
            rank=rank,
            world_size=2,
            stack_folder=str(tmp_path / "hangs"),
            on_hang=reports[rank].append,
            store=store,
            exit=exits[rank],
            grace_seconds=30,
        )
        for rank in (0, 1)
    ]
    for dog in dogs:
        dog.start()
        dog.beat()
    give_up = time.monotonic() + 60  # a bound on the loop, not an assertion on time
    with dogs[1].not_a_hang() if rank1 == "saving" else contextlib.nullcontext():
        while not exits[1].done.wait(0.05) and time.monotonic() < give_up:
            if rank1 == "moving":
                dogs[1].beat()  # rank 1 moves on
    assert exits[1].done.is_set()
    assert exits[0].done.wait(30)
    assert exits[0].code == exits[1].code == 75
    assert reports[1][0].detected_by == 0  # told by rank 0, not its own clock
    assert reports[0][0].detected_by == 0
    rank1 = (tmp_path / "hangs" / "hang-stacks-rank1.txt").read_text()
    assert "rank 0 saw no step progress" in rank1.splitlines()[0]


def _stepped_accelerator(tmp_path: Path, exit: _Exit) -> Accelerator:
    """A 1-process run under a 1 s hang timeout, one optimizer step in (the clock runs), whose
    watchdog records its exit instead of ending the test's process."""
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path), hang_timeout_seconds=1.0)
    watchdog = accelerator._watchdog.watchdog
    assert watchdog is not None
    watchdog._exit = exit
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()  # a step boundary: the clock starts
    return accelerator


def test_a_slow_save_load_or_wait_is_not_a_hang(tmp_path: Path) -> None:
    # A save (synchronous, then asynchronous: its capture) and a load each block for 2.5 s
    # under a 1 s timeout (a pre-hook that sleeps stands for a large state on slow storage):
    # no hang, and the clock starts afresh after each.
    exit = _Exit()
    accelerator = _stepped_accelerator(tmp_path, exit)
    try:
        slow = lambda *args: time.sleep(2.5)  # noqa: E731
        accelerator.register_save_state_pre_hook(slow)
        accelerator.register_load_state_pre_hook(slow)
        path = accelerator.save_state(str(tmp_path / "sync"))
        accelerator.load_state(path)
        accelerator.save_state(str(tmp_path / "async"), async_save=True)
        accelerator.wait_for_checkpoints()
        time.sleep(0.5)  # within the timeout of the fresh clock
    finally:
        accelerator.end_training()
    assert exit.code is None
    assert not (tmp_path / "hangs").exists()


def test_the_same_wait_outside_a_save_is_a_hang(tmp_path: Path) -> None:
    # The control of the test above: the same 2.5 s outside a save, after a step, is a hang.
    exit = _Exit()
    accelerator = _stepped_accelerator(tmp_path, exit)
    try:
        assert exit.done.wait(30)
    finally:
        accelerator.end_training()
    assert exit.code == 75
    assert (tmp_path / "hangs" / "hang-stacks-rank0.txt").exists()


def _stall_in_a_reduce(folder: str) -> str:
    """Rank 0 enters accelkit's all-reduce and stalls there (rank 1 joins only once rank 0's
    watchdog has written its stacks); rank 0 returns its stack file."""
    import torch

    from accelkit.runtime import ops
    from accelkit.runtime.state import PartialState

    state = PartialState(cpu=True)
    path = Path(stack_file(folder, 0))
    if state.process_index == 0:
        exit = _Exit()
        watchdog = Watchdog(0.5, rank=0, world_size=1, stack_folder=folder, exit=exit)
        watchdog.start()
        watchdog.beat()
        ops.reduce(torch.ones(1), "sum")
        assert exit.done.wait(30)
        watchdog.close()
        return path.read_text()
    deadline = time.monotonic() + 60
    while "Python stack" not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, "rank 0's watchdog wrote no stacks"
        time.sleep(0.05)
    ops.reduce(torch.ones(1), "sum")
    return ""


@pytest.mark.slow
def test_the_stack_file_names_the_collective_each_thread_entered_last(tmp_path: Path) -> None:
    text, _ = run_distributed(_stall_in_a_reduce, str(tmp_path / "hangs"))
    # The header, then the collective the hung thread entered and never left.
    trail = text.split("Every thread's Python stack")[0]
    assert "The collective each thread entered last through accelkit" in trail
    assert "MainThread: all_reduce (accelkit reduce), entered" in trail
    assert "not returned" in trail
