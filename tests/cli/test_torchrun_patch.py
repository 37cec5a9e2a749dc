"""The no-restart-after-preemption rule wraps a private method of torchrun's agent
(``accelkit/launch/_torchrun.py``): it is put in only on the torch versions it was checked
against, and this file fails as soon as the installed torch is not one of them or its agent no
longer has the shape the wrapper relies on. (The rule's effect, a preempted group left
unrestarted with ``--max_restarts 2``, is ``test_launch_preemption.py``'s.)"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from accelkit.launch import _torchrun


def test_the_restart_rule_applies_to_the_installed_torch() -> None:
    # If this fails after a torch upgrade: read SimpleElasticAgent._invoke_run of the new
    # torch, run test_launch_preemption.py, then widen RESTART_RULE_TORCH.
    assert _torchrun.restart_rule_applies() is None, torch.__version__
    # What the wrapper relies on: the run loop reads the monitoring result, then decides on a
    # restart from _remaining_restarts (which the wrapper sets to zero in between).
    source = inspect.getsource(SimpleElasticAgent._invoke_run)
    monitor = source.index("self._monitor_workers(")
    restarts = source.index("self._remaining_restarts > 0")
    assert monitor < restarts


def test_the_rule_is_put_in_on_a_checked_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    original = LocalElasticAgent._monitor_workers
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", original)  # restored after
    assert _torchrun._no_restart_after_preemption(["--max_restarts", "2"]) is True
    assert LocalElasticAgent._monitor_workers is not original


@pytest.mark.parametrize("version", ["2.3.1", "3.0.0+cu128", "nightly"])
def test_another_torch_keeps_torchruns_rule_and_says_so(
    version: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    why = _torchrun.restart_rule_applies(version)
    assert why is not None and version in why and "2.4 to 2.13" in why
    original = LocalElasticAgent._monitor_workers
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", original)
    monkeypatch.setattr(torch, "__version__", version)
    assert _torchrun._no_restart_after_preemption(["--max_restarts=2", "train.py"]) is False
    assert LocalElasticAgent._monitor_workers is original  # left as torch made it
    err = capsys.readouterr().err
    assert f"torch {version} is not among the versions" in err
    assert "may be restarted (--max_restarts)" in err
    # Without restarts to use there is nothing to say.
    assert _torchrun._no_restart_after_preemption(["train.py"]) is False
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("record", "codes", "expected"),
    [
        # The watchdog stopped the job; rank 0 then failed in its all-reduce (error file first).
        ({"exit_code": 75, "reason": "hang"}, {0: 1, 1: 75}, 75),
        ({"exit_code": 75, "reason": "hang"}, {0: -6, 1: 75}, 75),
        # No rank exited with the watchdog's code: a real failure.
        ({"exit_code": 75, "reason": "hang"}, {0: 1, 1: -15}, None),
        # A preemption record is not a hang.
        ({"exit_code": 75, "reason": "signal"}, {0: 1, 1: 75}, None),
        (None, {0: 1, 1: 75}, None),
    ],
)
def test_a_hang_stop_is_not_reported_as_the_failure_of_a_rank_it_took_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: Any, codes: dict, expected: Any
) -> None:
    from accelkit.runtime.preemption import (
        ENV_PREEMPTION_FILE,
        ENV_PREEMPTION_JOB,
        write_exit_record,
    )

    path = tmp_path / "exit.json"
    monkeypatch.setenv(ENV_PREEMPTION_FILE, str(path))
    monkeypatch.delenv(ENV_PREEMPTION_JOB, raising=False)
    if record is not None:
        write_exit_record(str(path), record)
    failures = {rank: SimpleNamespace(exitcode=code) for rank, code in codes.items()}
    assert _torchrun._hang_exit(failures) == expected
