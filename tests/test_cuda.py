"""The CUDA paths end to end: exact resume, CUDA generator states, fp16 with the grad scaler,
bf16 autocast, and a save made on the GPU loaded on the CPU (the pinned-memory async snapshot is in
``tests/checkpointing/test_async.py``).

Each test needs a CUDA device and is skipped (with that reason) without one; run them with
``pytest -m cuda`` on a machine that has one. The rest of the suite covers the same features on
the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelkit import Accelerator, ProjectConfiguration
from accelkit.runtime.random import set_seed
from accelkit.training.kwargs_handlers import GradScalerKwargs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(data, batch_size=8, shuffle=True)


def _accelerator(project: Path, mixed_precision: str = "no", **kwargs: Any) -> Accelerator:
    config = ProjectConfiguration(str(project), automatic_checkpoint_naming=True)
    return Accelerator(project_config=config, mixed_precision=mixed_precision, **kwargs)


def _train(
    project: Path,
    steps: int,
    *,
    save_at: int | None = None,
    resume: bool = False,
    mixed_precision: str = "no",
    async_save: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps (dropout and the shuffle draw from the generators),
    optionally saving after ``save_at`` steps or resuming first; return the final state."""
    set_seed(0)
    acc = _accelerator(project, mixed_precision)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, _loader())
    done = 0
    if resume:
        acc.load_state()
        done = acc.gradient_state.optimizer_steps
    losses = []
    while done < steps:
        for xb, yb in loader:
            with acc.autocast():
                loss = nn.functional.mse_loss(model(xb).float(), yb)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            done += 1
            if done == save_at:
                handle = acc.save_state(async_save=async_save)
                if async_save:
                    handle.result()  # type: ignore[union-attr]
            if done == steps:
                break
    acc.wait_for_everyone()
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "cuda_rng": torch.cuda.get_rng_state().clone(),
        "losses": losses,
        "scale": acc.scaler.get_scale() if acc.scaler is not None else None,
        "device": str(next(model.parameters()).device),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name
    for key, state in a["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value.cpu(), b["optimizer"]["state"][key][field].cpu()), field
    assert torch.equal(a["cuda_rng"], b["cuda_rng"])
    assert a["scale"] == b["scale"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_on_cuda_is_bitwise_the_uninterrupted_run(tmp_path: Path, async_save: bool) -> None:
    whole = _train(tmp_path / "whole", 20)
    assert whole["device"].startswith("cuda")
    _train(tmp_path / "split", 12, save_at=12, async_save=async_save)
    resumed = _train(tmp_path / "split", 20, resume=True)
    _assert_same(whole, resumed)
    assert resumed["losses"] == whole["losses"][12:]


def test_cuda_generator_state_is_saved_and_restored(tmp_path: Path) -> None:
    acc = _accelerator(tmp_path)
    model = acc.prepare(_model())
    torch.cuda.manual_seed(1234)
    path = acc.save_state()
    expected = torch.randn(1000, device="cuda")
    torch.cuda.manual_seed(99)  # a different stream, as a new process would have
    acc.load_state(path)
    assert torch.equal(torch.randn(1000, device="cuda"), expected)
    assert next(model.parameters()).is_cuda


def test_fp16_grad_scaler_state_round_trips(tmp_path: Path) -> None:
    acc = _accelerator(tmp_path, "fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**16)])
    model = _model()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 16, device=acc.device)
    for step in range(4):
        with acc.autocast():
            loss = model(x).float().square().mean()
        acc.backward(loss)
        if step == 1:  # an overflow halves the scale and skips the step
            next(model.parameters()).grad.fill_(float("inf"))  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
    assert acc.scaler is not None
    scale = acc.scaler.get_scale()
    assert scale == 2.0**15
    saved = acc.scaler.state_dict()
    path = acc.save_state()

    other = _accelerator(tmp_path, "fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    model2 = _model()
    model2, _ = other.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    other.load_state(path)
    assert other.scaler is not None
    assert other.scaler.get_scale() == scale
    assert other.scaler.state_dict() == saved


def test_bf16_runs_the_matmuls_in_bf16_and_returns_fp32(tmp_path: Path) -> None:
    acc = _accelerator(tmp_path, "bf16")
    model = acc.prepare(nn.Linear(16, 16))
    x = torch.randn(4, 16, device=acc.device)
    with acc.autocast():
        assert (x @ model.weight.T).dtype == torch.bfloat16
    # The prepared model autocasts its own forward and hands float32 back, as the reference.
    out = model(x)
    assert out.dtype == torch.float32
    full = nn.functional.linear(x, model.weight, model.bias)
    assert not torch.equal(out, full), "the forward ran in float32, not bf16"
    torch.testing.assert_close(out, full, rtol=0.05, atol=0.05)


def test_a_cuda_checkpoint_loads_on_the_cpu(tmp_path: Path) -> None:
    acc = _accelerator(tmp_path)
    model = _model()
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.backward(model(torch.randn(4, 16, device=acc.device)).sum())
    optimizer.step()
    path = acc.save_state()
    cpu = _accelerator(tmp_path, cpu=True)
    model2 = _model()
    model2, optimizer2 = cpu.prepare(model2, torch.optim.AdamW(model2.parameters()))
    cpu.load_state(path)
    for (name, value), other in zip(model.state_dict().items(), model2.state_dict().values()):
        assert other.device.type == "cpu" and torch.equal(value.cpu(), other), name
    state = optimizer2.state_dict()["state"][0]
    assert state["exp_avg"].device.type == "cpu"


def _fsdp_run(
    project: Path, steps: int, *, save_after: int | None, resume_from: str | None, async_save: bool
) -> dict[str, Any]:
    from accelkit.utils import FullyShardedDataParallelPlugin

    config = ProjectConfiguration(str(project), automatic_checkpoint_naming=True)
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(), project_config=config)
    torch.manual_seed(0 if resume_from is None else 5)  # the load must overwrite everything
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    out: dict[str, Any] = {"backend": torch.distributed.get_backend()}
    first = 0
    if resume_from is not None:
        acc.load_state(resume_from)
        first = save_after or 0
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 32, generator=g) for _ in range(steps)]
    for step in range(first, steps):
        acc.backward(model(batches[step].to(acc.device)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == save_after and resume_from is None:
            handle = acc.save_state(async_save=async_save)
            out["saved"] = handle.result() if async_save else handle  # type: ignore[union-attr]
    out["params"] = {k: v.cpu().clone() for k, v in acc.get_state_dict(model).items()}
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp2_on_one_gpu_saves_sharded_state_and_resumes_exactly(
    tmp_path: Path, async_save: bool
) -> None:
    whole = _fsdp_run(tmp_path, 6, save_after=3, resume_from=None, async_save=async_save)
    assert whole["backend"] == "nccl"  # FSDP2's one-process group on the GPU
    saved = whole["saved"]
    assert (Path(saved.split("://")[-1]) / "sharded" / ".metadata").is_file()
    resumed = _fsdp_run(tmp_path, 6, save_after=3, resume_from=saved, async_save=async_save)
    assert resumed["params"].keys() == whole["params"].keys()
    for name, value in whole["params"].items():
        assert torch.equal(resumed["params"][name], value), name


# A preemption on the GPU: the signal lands in backward (sync save) or while an async save's
# writer still runs (pinned snapshot); the run exits with the preemption code, leaves a committed
# checkpoint, and resumes bitwise equal to the uninterrupted run (parameters, optimizer state,
# CPU and CUDA generators).
@pytest.mark.parametrize(
    ("where", "at", "async_save"),
    [("backward", 9, False), ("async", 6, True)],
    ids=["sync-in-backward", "async-in-flight"],
)
def test_preemption_on_cuda_commits_and_resumes_bitwise(
    tmp_path: Path, where: str, at: int, async_save: bool
) -> None:
    from accelkit.cli.main import main
    from tests.helpers.preemption_job import train

    settings: dict[str, Any] = {"total": 16, "save_every": 6, "async_save": async_save}
    reference = train(str(tmp_path / "reference"), cpu=False, **settings)
    assert reference["device"].startswith("cuda")
    project = str(tmp_path / "run")
    first = train(project, cpu=False, where=where, signal_at=at, signum="SIGTERM", **settings)
    assert first["exit"] == 75
    assert main(["ckpt", "verify", str(Path(project) / "checkpoints")]) == 0
    resumed = train(project, cpu=False, resume=True, **settings)
    assert resumed["steps"] == reference["steps"] == 16
    assert resumed["digest"] == reference["digest"]


def test_process_writer_snapshots_into_pinned_shared_memory_without_blocking(
    tmp_path: Path,
) -> None:
    """The process writer's snapshot of CUDA tensors: page-locked shared memory (memfd
    segments registered with cudaHostRegister), filled by non-blocking copies; the call
    returns before the copies finish, the files match the state at the call, and the buffers
    are reused by the next save."""
    from accelkit.checkpointing.commit.writer_process import process_writer_available

    if not process_writer_available()[0]:
        pytest.skip(process_writer_available()[1])
    config = ProjectConfiguration(
        str(tmp_path), automatic_checkpoint_naming=True, async_writer="process"
    )
    acc = Accelerator(project_config=config)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)

    def step() -> None:
        loss = model(torch.randn(64, 1024, device=acc.device)).square().mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    step()
    acc.save_state(async_save=True).result(timeout=120)  # buffers allocated, writer started
    step()
    torch.cuda.synchronize()
    at_call = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handle = acc.save_state(async_save=True)
    for _ in range(3):  # queued on the GPU right after the call: must not reach the files
        step()
    saver = acc._checkpoints.background
    assert saver.last_writer == "process"
    buffers = saver.snapshot.buffers()
    arena = saver._arena
    assert arena is not None
    model_buffers = [b for k, b in buffers.items() if k[0] == "model"]
    assert model_buffers and all(arena.locate(b) is not None for b in model_buffers)
    assert all(b.is_pinned() for b in model_buffers)  # registered shared memory
    pointers = {k: b.data_ptr() for k, b in buffers.items()}
    path = handle.result(timeout=120)
    acc.save_state(async_save=True).result(timeout=120)
    assert {k: b.data_ptr() for k, b in saver.snapshot.buffers().items()} == pointers

    acc.load_state(path)
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), at_call[k]), k
    acc.end_training()
