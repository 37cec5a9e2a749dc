"""Wrapped optimizers and schedulers, gradient-accumulation state, the fp16 grad scaler (CPU)."""

from __future__ import annotations

import pickle

import pytest
import torch

from accelkit.training.optim import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    GradientAccumulationPlugin,
    GradientState,
    resolve_plugin,
)

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


def _model_and_opt(lr: float = 0.1) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def _backward(model: torch.nn.Module, scale: float = 1.0) -> None:
    (model(torch.ones(2, 3)).sum() * scale).backward()


def test_sync_pattern_follows_num_steps_and_the_end_of_the_dataloader() -> None:
    state = GradientState(GradientAccumulationPlugin(num_steps=2))
    assert [state.begin_micro_step() for _ in range(5)] == [False, True, False, True, False]

    class Loader:
        end_of_dataloader = True
        remainder = 3

    loader = Loader()
    state.enter_loader(loader)
    assert state.begin_micro_step() is True and state.micro_step == 0
    assert state.remainder == 3
    state.exit_loader(loader)
    assert state.remainder == -1 and not state.end_of_dataloader


def test_optimizer_skips_step_and_zero_grad_while_accumulating() -> None:
    model, inner = _model_and_opt()
    state = GradientState()
    opt = AcceleratedOptimizer(inner, state)
    before = model.weight.detach().clone()
    _backward(model)
    state.sync_gradients = False
    opt.step()
    opt.zero_grad()
    assert torch.equal(model.weight, before) and model.weight.grad is not None
    state.sync_gradients = True
    opt.step()
    assert not torch.equal(model.weight, before)
    assert state.optimizer_steps == 1 and not opt.step_was_skipped
    opt.zero_grad()
    assert model.weight.grad is None


def test_optimizer_passes_attributes_and_state_through() -> None:
    model, inner = _model_and_opt()
    opt = AcceleratedOptimizer(inner, GradientState())
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.defaults is inner.defaults
    opt.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5
    inner.custom_flag = "x"  # type: ignore[attr-defined]
    assert opt.custom_flag == "x"
    _backward(model)
    opt.step()
    state = opt.state_dict()
    assert state == inner.state_dict()
    _, other_inner = _model_and_opt()
    other = AcceleratedOptimizer(other_inner, GradientState())
    other.load_state_dict(state)
    assert other_inner.param_groups[0]["lr"] == 0.5
    # a scheduler can be built on the wrapper itself
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert pickle.loads(pickle.dumps(opt)).param_groups[0]["lr"] == pytest.approx(0.05)


def test_grad_scaler_skips_the_step_on_inf_and_the_scheduler_follows() -> None:
    model, inner = _model_and_opt()
    state = GradientState()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = AcceleratedOptimizer(inner, state, scaler)
    sched = AcceleratedScheduler(
        torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5), [opt], state
    )
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    opt.step()
    sched.step()
    assert opt.step_was_skipped
    assert torch.equal(model.weight, before)
    assert scaler.get_scale() == 2.0**9
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1)  # scheduler held back
    assert state.optimizer_steps == 0
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    assert opt.unscale_() is True and opt.unscale_() is False  # once per step
    grad = model.weight.grad.clone()  # type: ignore[union-attr]
    assert torch.allclose(grad, torch.full_like(grad, 2.0))  # unscaled: d(sum)/dw = 2 rows
    opt.step()
    sched.step()
    assert not opt.step_was_skipped
    assert not torch.equal(model.weight, before)
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("split", "procs", "expected"), [(False, 2, 2), (True, 2, 1), (False, 1, 1)]
)
def test_scheduler_steps_once_per_process_per_optimizer_step(
    split: bool, procs: int, expected: int
) -> None:
    _, inner = _model_and_opt()
    state = GradientState()
    opt = AcceleratedOptimizer(inner, state)
    lam = torch.optim.lr_scheduler.LambdaLR(inner, lambda n: 1.0 / (1 + n))
    sched = AcceleratedScheduler(lam, [opt], state, split_batches=split, num_processes=procs)
    state.sync_gradients = False
    sched.step()
    assert lam.last_epoch == 0
    state.sync_gradients = True
    sched.step()
    assert lam.last_epoch == expected
    assert sched.get_last_lr() == lam.get_last_lr()
    copy = sched.state_dict()
    assert copy["last_epoch"] == expected


def test_scheduler_without_step_with_optimizer_always_steps() -> None:
    _, inner = _model_and_opt()
    state = GradientState()
    lam = torch.optim.lr_scheduler.LambdaLR(inner, lambda n: 1.0)
    sched = AcceleratedScheduler(lam, [], state, step_with_optimizer=False, num_processes=4)
    state.sync_gradients = False
    sched.step()
    assert lam.last_epoch == 1


def test_one_cycle_is_not_stepped_past_its_total() -> None:
    _, inner = _model_and_opt()
    state = GradientState()
    cycle = torch.optim.lr_scheduler.OneCycleLR(inner, max_lr=1.0, total_steps=3)
    sched = AcceleratedScheduler(cycle, [], state, num_processes=2)
    for _ in range(3):
        sched.step()  # would raise inside OneCycleLR past total_steps
    assert cycle._step_count == 4


def test_plugin_validation() -> None:
    with pytest.raises(ValueError, match="num_steps=0"):
        GradientAccumulationPlugin(num_steps=0)
    assert resolve_plugin(None, 4).num_steps == 4
    with pytest.raises(ValueError, match="only one"):
        resolve_plugin(GradientAccumulationPlugin(num_steps=2), 3)
    with pytest.raises(TypeError, match="dict"):
        resolve_plugin({"num_steps": 2})  # type: ignore[arg-type]


def test_gradient_state_without_a_plugin_is_the_newest_accelerators() -> None:
    """Accelerate's ``GradientState()`` is a shared state: a script's own ``GradientState()``
    sees the accelerator's accumulation settings and sync flag."""
    import pickle

    from accelkit import Accelerator
    from accelkit.state import GradientState as FaceGradientState

    accelerator = Accelerator(cpu=True)
    state = FaceGradientState()
    assert state is accelerator.gradient_state and state.num_steps == 1
    accelerator.gradient_accumulation_steps = 4
    assert state.num_steps == 4
    accelerator.sync_gradients = False
    assert GradientState().sync_gradients is False
    # A copy is its own object and does not become the shared state.
    copied = pickle.loads(pickle.dumps(state))
    assert copied is not state and copied.num_steps == 4 and GradientState() is state
    # A plugin makes a new state (each Accelerator does), which becomes the shared one.
    newer = Accelerator(cpu=True, gradient_accumulation_steps=3)
    assert GradientState() is newer.gradient_state is not state
    assert accelerator.gradient_state.num_steps == 4  # the first accelerator keeps its own
    GradientState._reset_state()
    fresh = GradientState()
    assert fresh is not newer.gradient_state and fresh.num_steps == 1
    assert GradientState() is fresh
