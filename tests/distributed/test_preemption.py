"""Preemption on 2 real processes (gloo on 127.0.0.1, issue 25): a signal to one worker only
ends in one checkpoint agreed by both, at the step it arrived (or the next), resumed bitwise
equal to an uninterrupted run; ``should_save()`` decisions are identical on every process
whatever their clocks say.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.preemption_job import train

# Steps of 50 ms or more: the processes agree at every step (faster steps are grouped into
# rounds of ~50 ms, see accelkit.runtime.preemption.ROUND_SECONDS).
SETTINGS: dict[str, Any] = {"total": 16, "eval_every": 5, "save_every": 6, "step_sleep": 0.05}


def _job(project: str, settings: dict[str, Any]) -> dict[str, Any]:
    return train(project, **settings)


def _manifests(project: Path) -> list[tuple[int, str]]:
    root = project / "checkpoints"
    found = [json.loads((p / "accelkit.json").read_text()) for p in root.iterdir()]
    return sorted((m["step"], m["reason"]) for m in found)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each rank's digest after an uninterrupted run."""
    project = tmp_path_factory.mktemp("reference")
    return [r["digest"] for r in run_distributed(_job, str(project), SETTINGS)]


# SIGUSR1 to rank 1 only: in the backward pass of step 10 (sync saves), or in the evaluation
# after step 10 (async saves). Either is agreed and saved at step 10 or 11.
@pytest.mark.parametrize(
    ("async_save", "where", "at"),
    [(False, "backward", 9), (True, "eval", 10)],
    ids=["sync-backward", "async-eval"],
)
def test_signal_to_one_worker_saves_on_both_and_resumes_bitwise_equal(
    tmp_path: Path, reference: list[str], async_save: bool, where: str, at: int
) -> None:
    settings = {**SETTINGS, "async_save": async_save}
    first = run_distributed(
        _job, str(tmp_path), {**settings, "where": where, "signal_at": at, "signal_rank": 1}
    )
    assert [r["exit"] for r in first] == [75, 75]
    checkpoints = _manifests(tmp_path)
    assert checkpoints[0] == (6, "user")
    (preempted,) = checkpoints[1:]
    assert preempted[1] == "preemption" and preempted[0] in (10, 11)
    resumed = run_distributed(_job, str(tmp_path), {**settings, "resume": True})
    assert [r["digest"] for r in resumed] == reference


def test_signal_before_the_first_step_on_two_processes(tmp_path: Path) -> None:
    first = run_distributed(_job, str(tmp_path), {**SETTINGS, "where": "before", "signal_rank": 0})
    assert [r["exit"] for r in first] == [75, 75]
    # Agreed one boundary later on 2 processes: the first step at the latest.
    (only,) = _manifests(tmp_path)
    assert only[1] == "preemption" and only[0] in (0, 1)


def test_a_script_that_asks_is_saved_once_on_two_processes(tmp_path: Path) -> None:
    settings = {"total": 16, "mode": "explicit", "step_sleep": 0.05}
    reference = run_distributed(_job, str(tmp_path / "reference"), settings)
    project = tmp_path / "run"
    first = run_distributed(
        _job, str(project), {**settings, "where": "step", "signal_at": 6, "signal_rank": 1}
    )
    assert [r["exit"] for r in first] == [75, 75]
    (only,) = _manifests(project)
    assert only[1] == "preemption" and only[0] in (7, 8)
    resumed = run_distributed(_job, str(project), {**settings, "resume": True})
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]


def _skewed_decisions(project: str, calls: int) -> list[bool]:
    import torch

    from accelkit import Accelerator, ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=True,
        save_every_seconds=0.05,
        total_limit=2,
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    rank = accelerator.process_index
    # Rank 1's clock is a day ahead and runs 3 times as fast: decided from each process's own
    # clock, rank 1 would want a save at almost every call.
    offset, rate, start = 86400.0 * rank, 1.0 + 2.0 * rank, time.monotonic()
    accelerator._preemption.decider.use_clock(lambda: offset + rate * (time.monotonic() - start))
    accelerator.prepare(torch.nn.Linear(2, 2))
    decisions = []
    for _ in range(calls):
        due = accelerator.should_save()
        decisions.append(due)
        if due:
            accelerator.save_state()
        time.sleep(0.001 * (1 + rank))  # and the processes run at different speeds
    accelerator.end_training()
    return decisions


def test_should_save_by_seconds_is_identical_on_processes_whose_clocks_differ(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run_distributed(_skewed_decisions, str(tmp_path), 1000, timeout=240)
    assert len(rank0) == len(rank1) == 1000
    assert rank0 == rank1  # 1,000 of 1,000 calls
    assert 5 <= sum(rank0) <= 500  # the interval did come due, and not at every call


def _round_schedule(project: str, steps: int) -> dict[str, Any]:
    """Fast steps (~2 ms) with ``should_save()`` each: the steps at which rounds of the
    agreement started, the ``round_every`` in force at each, and the reduced tensor's address
    after each (one tensor for the whole run)."""
    import torch

    from accelkit import Accelerator, ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=True,
        preemption_signals=("SIGUSR1",),
        save_every_steps=10**9,
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(steps, 4))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    decider = accelerator._preemption.decider
    agreement = decider.agreement
    rounds: list[tuple[int, int]] = []
    addresses: set[int] = set()
    poll = agreement.poll

    def recording_poll(local: list[int]) -> list[int]:
        rounds.append((accelerator.gradient_state.optimizer_steps, decider.round_every))
        agreed = poll(local)
        addresses.add(agreement._tensor.data_ptr())
        return agreed

    agreement.poll = recording_poll  # type: ignore[method-assign]
    for (x,) in loader:
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.002)
        assert not accelerator.should_save()
    accelerator.end_training()
    return {"rounds": rounds, "addresses": len(addresses)}


def test_fast_steps_are_grouped_into_rounds_the_same_on_every_process(tmp_path: Path) -> None:
    # Steps of a few ms: the main process measures them and the processes agree on starting a
    # round only every round_every steps (~50 ms of training); a round is never started early
    # by the step-less rule while steps are being taken (it used to fire every 8 boundaries,
    # i.e. every 4 steps here, whatever round_every said), and it reuses one tensor.
    rank0, rank1 = run_distributed(_round_schedule, str(tmp_path), 300, timeout=240)
    assert rank0["rounds"] == rank1["rounds"]  # the same rounds, by construction
    rounds = rank0["rounds"]
    assert max(every for _, every in rounds) > 4, rounds  # grouping happened at all
    for (before, _), (after, every) in itertools.pairwise(rounds):
        assert after - before >= every, rounds
    assert len(rounds) < 300 // 4, rounds
    assert rank0["addresses"] == rank1["addresses"] == 1
