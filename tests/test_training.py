"""The Accelerator's training loop: prepare, accumulation, mixed precision, gather_for_metrics.

The same loop body (:func:`_full_loop`) runs in this process and on 2 real gloo processes; the
multi-process jobs are few and each checks many things, because every spawn costs seconds here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from accelkit import Accelerator
from accelkit.data.preparation import DataLoaderConfiguration, PreparedDataLoader
from accelkit.runtime.random import set_seed
from accelkit.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
)
from accelkit.training.optim import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    GradientAccumulationPlugin,
)
from accelkit.training.precision import AutocastForward
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


SEEDABLE = DataLoaderConfiguration(use_seedable_sampler=True)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return _mlp().state_dict()


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


# ------------------------------------------------------------- the loop, any number of processes


def _full_loop(mixed_precision: str = "no", cpu: bool = True) -> dict[str, Any]:
    """Train and evaluate with every training-loop function; return what was observed."""
    set_seed(0)
    # The seedable sampler: its order does not depend on the number of processes, so 2 x 2
    # batches reproduce 1 x 4, and set_epoch replays an epoch.
    acc = Accelerator(
        gradient_accumulation_steps=2,
        mixed_precision=mixed_precision,
        cpu=cpu,
        dataloader_config=SEEDABLE,
    )
    model = _mlp()
    model.load_state_dict(_initial_weights())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0)
    x, y = _data()
    train = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True)
    evaluation = DataLoader(TensorDataset(torch.arange(9)), batch_size=2)
    model, optimizer, train, scheduler, evaluation = acc.prepare(
        model, optimizer, train, scheduler, evaluation
    )
    out: dict[str, Any] = {"world": acc.num_processes, "syncs": [], "norms": [], "skipped": []}
    for xb, yb in train:
        with acc.accumulate(model):
            prediction = model(xb)
            out["output_dtype"] = prediction.dtype
            loss = torch.nn.functional.mse_loss(prediction, yb)
            acc.backward(loss)
            out["syncs"].append(acc.sync_gradients)
            if acc.sync_gradients:
                acc.unscale_gradients()
                out["norms"].append(float(acc.clip_grad_norm_(model.parameters(), 1e6)))
                acc.clip_grad_value_(model.parameters(), 1e6)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            out["skipped"].append(acc.optimizer_step_was_skipped)
    out["weights"] = {k: v.float().clone() for k, v in acc.get_state_dict(model).items()}
    out["scheduler_steps"] = scheduler.scheduler.last_epoch
    out["optimizer_steps"] = acc.gradient_state.optimizer_steps
    with acc.autocast():
        out["autocast_dtype"] = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype

    # a short epoch: the last batch synchronises although it does not complete 2 micro-steps
    short = acc.prepare(DataLoader(TensorDataset(x[:12], y[:12]), batch_size=2))
    out["short_syncs"] = []
    for xb, yb in short:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
            out["short_syncs"].append(acc.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()

    # evaluation: 9 items on any number of processes gather to exactly 9
    model.eval()
    items, pairs, names = [], [], []
    for (batch,) in evaluation:
        items.append(acc.gather_for_metrics(batch))
        pairs.append(acc.gather_for_metrics({"x": batch, "twice": (batch * 2,)}))
        names += acc.gather_for_metrics([f"s{int(i)}" for i in batch], use_gather_object=True)
    out["eval"] = torch.cat(items).tolist()
    out["eval_pairs"] = torch.cat([p["twice"][0] for p in pairs]).tolist()
    out["eval_names"] = names

    # resuming in the middle of an epoch
    epoch = train.epoch
    replay = [xb for xb, _ in train]
    train.set_epoch(epoch)
    skipped = acc.skip_first_batches(train, 2)
    first = next(iter(skipped))[0]
    out["skip_matches"] = torch.equal(first, replay[2]) and len(skipped) == len(replay) - 2
    out["skipped_first"] = first.tolist()
    out["train_state"] = train.state_dict()

    out["unwrapped_type"] = type(acc.unwrap_model(model)).__name__
    out["wrapped_type"] = type(model).__name__
    out["step"] = acc.step
    out["freed"] = acc.free_memory(model, optimizer)
    out["after_free"] = (len(acc._models), len(acc._optimizers), acc.step)
    return out


def _check_full_loop(out: dict[str, Any], world: int) -> None:
    steps_per_epoch = 32 // (2 * world)
    assert out["syncs"] == [False, True] * (steps_per_epoch // 2)
    assert out["short_syncs"] == ([False, True, True] if world == 2 else [False, True] * 3)
    assert out["optimizer_steps"] == steps_per_epoch // 2
    assert out["scheduler_steps"] == (steps_per_epoch // 2) * world
    assert out["eval"] == list(range(9))
    assert out["skip_matches"]
    assert out["train_state"]["batches_yielded"] == 3
    assert out["eval_pairs"] == [2 * i for i in range(9)]
    assert out["eval_names"] == [f"s{i}" for i in range(9)]
    assert out["output_dtype"] == torch.float32
    assert out["freed"] == (None, None)
    assert out["after_free"] == (0, 0, 0)
    assert out["unwrapped_type"] == "Sequential"
    assert out["wrapped_type"] == ("DistributedDataParallel" if world > 1 else "Sequential")


def _single_process_reference() -> dict[str, torch.Tensor | list[float]]:
    """One process, batches of 8, no accumulation: what 2 x 2 x 2 must reproduce."""
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=SEEDABLE)
    model = _mlp()
    model.load_state_dict(_initial_weights())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model, optimizer, train = acc.prepare(model, optimizer, train)
    norms = []
    for xb, yb in train:
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 1e6)))
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": model.state_dict(), "norms": norms}


def _sync_controls() -> dict[str, Any]:
    """no_sync / trigger_sync_in_backward / join_uneven_inputs on real DDP."""
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = acc.prepare(_mlp())
    rank = acc.process_index
    inputs = torch.full((2, 4), float(rank + 1))
    out: dict[str, Any] = {}
    with acc.no_sync(model):
        loss_a = model(inputs).sum()
        loss_b = model(inputs * 2).sum()
    acc.backward(loss_a)
    out["after_no_sync"] = _grads(model)
    with acc.trigger_sync_in_backward(model):
        acc.backward(loss_b)
    out["after_trigger"] = _grads(model)

    # uneven inputs: 5 batches on 2 processes -> 3 and 2; Join keeps DDP from hanging
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    loader = acc.prepare(DataLoader(torch.randn(5, 4), batch_size=1))
    optimizer = acc.prepare(optimizer)
    count = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        for xb in loader:
            acc.backward(model(xb).sum())
            optimizer.step()
            optimizer.zero_grad()
            count += 1
    out["uneven_batches"] = count
    out["even_batches_restored"] = loader._shard.even_batches
    out["weights_after_join"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return out


def _distributed_job() -> dict[str, Any]:
    out = _full_loop("no")
    out["bf16"] = _full_loop("bf16")
    out["sync"] = _sync_controls()
    return out


@pytest.mark.slow
def test_two_processes_match_one_and_every_function_runs() -> None:
    reference = _single_process_reference()
    results = run_distributed(_distributed_job, world_size=2)
    for out in results:
        _check_full_loop(out, world=2)
        _check_full_loop(out["bf16"], world=2)
        assert out["bf16"]["autocast_dtype"] == torch.bfloat16
        assert out["autocast_dtype"] == torch.float32
        # 2 processes x 2 micro-steps x batch 2 == 1 process x batch 8, to 1e-5
        for name, value in reference["weights"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(out["weights"][name], value, atol=1e-5, rtol=0)
        assert out["norms"] == pytest.approx(reference["norms"], abs=1e-5)
    # the shards differ but every rank ends with the same weights and saw the same norms
    assert results[0]["skipped_first"] != results[1]["skipped_first"]
    assert results[0]["train_state"] == results[1]["train_state"]
    sync0, sync1 = results[0]["sync"], results[1]["sync"]
    assert not torch.equal(sync0["after_no_sync"], sync1["after_no_sync"])
    torch.testing.assert_close(sync0["after_trigger"], sync1["after_trigger"])
    assert (sync0["uneven_batches"], sync1["uneven_batches"]) == (3, 2)
    assert sync0["even_batches_restored"] is True
    torch.testing.assert_close(sync0["weights_after_join"], sync1["weights_after_join"])


@pytest.mark.slow
def test_one_process_runs_the_same_loop() -> None:
    out = _full_loop("no")
    _check_full_loop(out, world=1)
    assert out["skipped"] == [False] * 16
    bf16 = _full_loop("bf16")
    _check_full_loop(bf16, world=1)
    assert bf16["autocast_dtype"] == torch.bfloat16
    controls = _sync_controls()  # DDP-only controls are harmless no-ops on one process
    assert controls["uneven_batches"] == 5
    assert not torch.equal(controls["after_trigger"], controls["after_no_sync"])  # accumulated


# ---------------------------------------------------------------- mixed precision, one process


@pytest.mark.slow
def test_fp16_on_cpu_scales_unscales_and_skips_on_inf() -> None:
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    assert isinstance(model.forward, AutocastForward)
    x, y = _data(8)
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    scale = acc.scaler.get_scale()
    scaled_norm = float(_grads(model).norm())
    norm = acc.clip_grad_norm_(model.parameters(), 1e6)
    assert float(norm) == pytest.approx(scaled_norm / scale, rel=1e-3)  # unscaled first
    optimizer.step()
    assert not acc.optimizer_step_was_skipped
    optimizer.zero_grad()

    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
    optimizer.step()
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert acc.scaler.get_scale() < scale

    out = _full_loop("fp16")
    assert out["output_dtype"] == torch.float32 and out["eval"] == list(range(9))
    assert out["autocast_dtype"] == torch.float16


def test_fp16_clip_while_accumulating_leaves_scaled_gradients_alone() -> None:
    acc = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=2, cpu=True)
    model = _mlp()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with acc.accumulate(model):
        acc.backward(model(torch.ones(2, 4)).sum())
        grads = _grads(model).clone()
        assert not acc.sync_gradients
        assert acc.clip_grad_norm_(model.parameters(), 1e-3) is None
        assert torch.equal(_grads(model), grads)


def test_mixed_precision_default_comes_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("ACCELKIT_MIXED_PRECISION", "bf16")
    acc = Accelerator(cpu=True)
    assert acc.mixed_precision == "bf16" and acc.scaler is None
    model = acc.prepare(_mlp())
    assert isinstance(model.forward, AutocastForward)
    assert model(torch.ones(1, 4)).dtype == torch.float32
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in plain.__dict__
    monkeypatch.setenv("ACCELKIT_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="fp8"):
        Accelerator()


# --------------------------------------------------------------------------- prepare itself


def test_prepare_returns_objects_in_order_and_passes_others_through() -> None:
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(torch.arange(4), batch_size=2)
    marker = object()
    out = acc.prepare(scheduler, marker, loader, optimizer, model, "text")
    assert isinstance(out[0], AcceleratedScheduler) and out[0].optimizers == [out[3]]
    assert out[1] is marker and out[5] == "text"
    assert isinstance(out[2], PreparedDataLoader) and isinstance(out[3], AcceleratedOptimizer)
    assert out[4] is model and not isinstance(out[4], DistributedDataParallel)
    assert acc.gradient_accumulation_steps == 3
    assert acc.prepare(out[3]) is out[3] and len(acc._optimizers) == 1  # idempotent
    assert acc._dataloaders == [out[2]] and acc._schedulers == [out[0]]
    kept = acc.prepare(torch.nn.Linear(1, 1), device_placement=[False])
    assert isinstance(kept, torch.nn.Linear)
    with pytest.raises(ValueError, match="1 entries for 2 objects"):
        acc.prepare(model, optimizer, device_placement=[True])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (TensorDataset(torch.arange(3)), "cannot handle a TensorDataset.*DataLoader\\(dataset"),
        (torch.nn.Linear, "the class Linear"),
        ([torch.nn.Linear(1, 1)], "list holding Linear.*prepare\\(\\*objects\\)"),
    ],
)
def test_prepare_refuses_likely_mistakes_naming_the_type(bad: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        Accelerator().prepare(bad)


def test_kwargs_handlers_reach_the_scaler_ddp_and_autocast() -> None:
    acc = Accelerator(
        mixed_precision="fp16",
        cpu=True,
        kwargs_handlers=[
            GradScalerKwargs(init_scale=8.0, growth_interval=3),
            DistributedDataParallelKwargs(find_unused_parameters=True),
        ],
    )
    assert acc.scaler is not None and acc.scaler.get_scale() == 8.0
    assert acc.scaler.get_growth_interval() == 3
    assert acc._ddp_kwargs == {"find_unused_parameters": True}
    with acc.autocast(AutocastKwargs(enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with acc.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
    with pytest.raises(TypeError, match="to_kwargs"):
        acc.autocast(42)


def test_split_batches_and_config_reach_the_loader() -> None:
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    assert acc.dataloader_config.even_batches is False
    acc = Accelerator(split_batches=True)
    loader = acc.prepare(DataLoader(torch.arange(8), batch_size=4))
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one process: whole
    assert acc.prepare_scheduler(
        torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_mlp().parameters()), 1)
    ).split_batches


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_on_cuda_with_grad_scaler_and_skip_on_inf() -> None:
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    assert acc.device.type == "cuda" and acc.scaler is not None
    assert acc.scaler.get_scale() == 1024
    torch.manual_seed(0)
    model = _mlp()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(8)
    loader = acc.prepare(DataLoader(TensorDataset(x, y), batch_size=4))
    for xb, yb in loader:
        assert xb.device.type == "cuda"
        with acc.autocast():
            assert (xb @ xb.T).dtype == torch.float16
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        assert not acc.optimizer_step_was_skipped
        optimizer.zero_grad()
    acc.backward(model(x.cuda()).sum())
    next(model.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
    optimizer.step()
    assert acc.optimizer_step_was_skipped
    out = _full_loop("fp16", cpu=False)
    assert out["eval"] == list(range(9)) and out["output_dtype"] == torch.float32
