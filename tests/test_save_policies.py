"""Save policies are objects (``accelkit.runtime.saving``) and preemption plugs in through hooks
(``GradientState.on_boundary``, the save path's observers), never by setting attributes on other
parts. The policies' agreement across processes is ``tests/distributed/test_preemption.py``'s;
a preemption's save and exit is ``tests/test_preemption.py``'s."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.errors import ConfigurationError
from accelkit.runtime.saving import (
    AnyOf,
    EveryNSteps,
    EverySeconds,
    OnPreemption,
    Progress,
    SavePolicy,
    SavePolicyError,
)
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


class AtSteps:
    """A user's policy: save at the listed optimizer steps."""

    reason, shared = "interval", False

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    def due(self, progress: Progress) -> bool:
        return progress.steps in self.steps and progress.steps != progress.last_save_step


def _train(accelerator: Accelerator, steps: int, pause: float = 0.0) -> list[int]:
    """``steps`` optimizer steps (``pause`` seconds each at least), saving when
    ``should_save()`` says; the steps saved at."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(steps, 2))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=1)
    )
    saved = []
    for (x,) in loader:
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(pause)
        if accelerator.should_save():
            accelerator.save_state()
            saved.append(accelerator.gradient_state.optimizer_steps)
    accelerator.end_training()
    return saved


def test_a_users_policy_decides_should_save_and_the_manifest_reason(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config, save_policy=AtSteps(2, 5))
    assert _train(accelerator, 7) == [2, 5]
    manifests = sorted(tmp_path.rglob("accelkit.json"))
    assert [json.loads(m.read_text())["reason"] for m in manifests] == ["interval", "interval"]


def test_any_of_a_users_policy_and_every_n_steps(tmp_path: Path) -> None:
    policy = AnyOf(AtSteps(3), EveryNSteps(5))
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config, save_policy=policy)
    assert _train(accelerator, 11) == [3, 8]  # every 5 counts from the last save


def test_a_policy_with_the_save_every_settings_or_not_a_policy_is_refused(
    tmp_path: Path,
) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), save_every_steps=100)
    with pytest.raises(ConfigurationError, match=r"save_every_steps=100.*AnyOf\(EveryNSteps"):
        Accelerator(cpu=True, project_config=config, save_policy=AtSteps(1))
    with pytest.raises(ConfigurationError, match="'every 100' is not a save policy"):
        Accelerator(cpu=True, save_policy="every 100")  # type: ignore[arg-type]

    class Wrong(AtSteps):
        reason = "because"

    with pytest.raises(ConfigurationError, match=r"reason='because'.*'interval'"):
        AnyOf(Wrong())
    with pytest.raises(ConfigurationError, match=r"EveryNSteps\(steps\)=0.*> 0"):
        EveryNSteps(0)
    with pytest.raises(ConfigurationError, match="inf"):
        EverySeconds(float("inf"))


def test_the_built_in_policies() -> None:
    def progress(steps: int, last: int | None = None, **kw: object) -> Progress:
        values: dict[str, object] = {"seconds_since_save": None, "preempted": False}
        values |= {"saved_since_preemption": False, **kw}
        return Progress(steps, last, **values)  # type: ignore[arg-type]

    assert isinstance(AtSteps(1), SavePolicy)
    every = EveryNSteps(4)
    assert [s for s in range(10) if every.due(progress(s))] == [4, 5, 6, 7, 8, 9]
    assert not every.due(progress(6, last=4)) and every.due(progress(8, last=4))
    assert not EverySeconds(5).due(progress(1))  # a local view has no clock
    assert EverySeconds(5).due(progress(1, seconds_since_save=5.0))
    assert OnPreemption().due(progress(1, preempted=True))
    assert not OnPreemption().due(progress(1, preempted=True, saved_since_preemption=True))
    nested = AnyOf(every, AnyOf(EverySeconds(5), OnPreemption()))
    assert nested.policies == (every, *nested.policies[1:]) and len(nested.policies) == 3
    assert nested.reason == "preemption" and nested.shared
    assert repr(nested) == "AnyOf(EveryNSteps(4), EverySeconds(5), OnPreemption())"


def test_the_step_boundary_hooks_see_each_batch_and_step_and_are_removed() -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(2, 2))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=1)
    )
    boundary = accelerator.gradient_state.on_boundary
    assert boundary.hooks == ()  # without preemption signals nothing runs at a boundary
    seen: list[tuple[str, str]] = []
    remove = boundary.register(lambda where, source: seen.append((where, type(source).__name__)))
    for (x,) in loader:
        accelerator.backward(model(x).sum())
        optimizer.step()
    remove()
    optimizer.step()
    names = [(w, "loader" if "Loader" in s else "optimizer") for w, s in seen]
    assert names == [
        ("batch", "loader"),
        ("step", "optimizer"),
        ("batch", "loader"),
        ("step", "optimizer"),
        ("end", "loader"),
    ]


def test_preemption_registers_its_hook_and_end_training_removes_it(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), preemption_signals="SIGUSR1")
    accelerator = Accelerator(cpu=True, project_config=config)
    assert len(accelerator.gradient_state.on_boundary.hooks) == 1
    accelerator.end_training()
    assert accelerator.gradient_state.on_boundary.hooks == ()


def test_the_preemption_part_assigns_attributes_only_on_itself() -> None:
    # Issue 38: preemption attached itself by assigning attributes on the checkpointing part
    # and the step state (hidden upward calls); it registers with their hooks instead.
    source = (ROOT / "accelkit" / "_accelerator" / "preemption.py").read_text()
    # Only self.name = ... (self.part.name = ... assigns on another part).
    foreign = [
        f"line {node.lineno}: {ast.unparse(target)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for attribute in ast.walk(target)
        if isinstance(attribute, ast.Attribute)
        and not (isinstance(attribute.value, ast.Name) and attribute.value.id == "self")
    ]
    assert foreign == []


class RaisesAtStep:
    """A user's shared policy (it reads the main process's view) whose ``due()`` raises."""

    reason, shared = "interval", True

    def __init__(self, step: int) -> None:
        self.step = step

    def due(self, progress: Progress) -> bool:
        if progress.steps >= self.step:
            raise OSError("the policy's file is gone")
        return False


def _train_with_a_failing_shared_policy(project: str) -> tuple[str, str, bool, int]:
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=project),
        save_policy=RaisesAtStep(3),
    )
    try:
        _train(accelerator, 40, pause=0.06)  # a round at each step (ROUND_SECONDS)
    except SavePolicyError as error:
        cause = error.__cause__
        steps = accelerator.gradient_state.optimizer_steps
        return type(error).__name__, str(error), isinstance(cause, OSError), steps
    return "no error", "", False, accelerator.gradient_state.optimizer_steps


def test_a_shared_policy_that_raises_stops_every_process_at_one_boundary(tmp_path: Path) -> None:
    # Asked on the main process only, its failure is agreed: the other process raises at the
    # same boundary instead of waiting in the next collective for a process that left.
    results = run_distributed(
        _train_with_a_failing_shared_policy, str(tmp_path), world_size=2, timeout=90
    )
    (main_kind, main_text, main_cause, main_steps), (kind, text, cause, steps) = results
    assert main_kind == kind == "SavePolicyError"
    assert "OSError" in main_text and "the policy's file is gone" in main_text and main_cause
    assert "raised on the main process" in text and not cause
    assert main_steps == steps and 3 <= steps < 40


def test_a_policy_that_raises_on_one_process_raises_from_the_loop(tmp_path: Path) -> None:
    kind, text, cause, steps = _train_with_a_failing_shared_policy(str(tmp_path))
    # one process: nothing to agree; raised at the boundary where it was asked
    assert (kind, cause, steps) == ("SavePolicyError", True, 3)
    assert "OSError" in text and "Fix the policy" in text
