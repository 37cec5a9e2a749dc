"""Overlapped asynchronous saves (``ProjectConfiguration(async_snapshot="overlapped")``): the
large parameters and state of the prepared optimizers are copied by a background thread while
training goes on.

The race between that copy and training is made deterministic by holding the copy thread back
on an ``Event`` (``snapshot._deferred_memmoves`` replaced by a gate), never by sleeping: a test
releases it once the state it wants to check is reached. Both writers (thread and process) are
real; a writer crash is a real ``kill -9``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.commit import snapshot, writer_process
from accelkit.checkpointing.errors import CheckpointError
from accelkit.errors import ConfigurationError
from accelkit.local_sgd import LocalSGD
from tests.checkpointing.test_async_writer import (
    _accelerator,
    _committed,
    _kill_the_writer_mid_save,
    _writer,
)
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("open_gate")

_PROCESS = pytest.mark.skipif(
    not writer_process.process_writer_available()[0],
    reason=writer_process.process_writer_available()[1] or "process writer available",
)
WIDTH = 256  # a 256 KiB weight: over the 64 KiB below which guarded tensors are copied at once


class Gate:
    """Holds the snapshot's background copy until :meth:`release`; counts the tensors copied."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.copied = 0
        original = snapshot._deferred_memmoves

        def gated(pieces: list[tuple[int, int, int]]) -> None:
            self.entered.set()
            assert self.opened.wait(60), "the test never released the copy"
            original(pieces)
            self.copied += 1

        monkeypatch.setattr(snapshot, "_deferred_memmoves", gated)

    def release(self) -> None:
        self.opened.set()

    def hold(self) -> None:
        """Hold the next copies back again."""
        self.entered.clear()
        self.opened.clear()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.release()  # never leave a copy thread (and a save) hanging


def _setup(project: Path, **config: Any) -> tuple[Accelerator, nn.Module, Any, list[torch.Tensor]]:
    torch.manual_seed(0)
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True, **config
        ),
    )
    # BatchNorm: buffers that forward changes (copied at once); the Linears: guarded tensors.
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    batches = [torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    return acc, model, optimizer, batches


def _step(model: nn.Module, optimizer: Any, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, per_param in optimizer.state_dict()["state"].items():
        for name, value in per_param.items():
            out[f"optimizer.{index}.{name}"] = torch.as_tensor(value).clone()
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


def test_async_snapshot_setting_is_validated() -> None:
    with pytest.raises(ConfigurationError) as info:
        ProjectConfiguration(async_snapshot="overlap")
    text = str(info.value)
    assert "'overlap'" in text and "'blocking'" in text and "'overlapped'" in text
    assert ProjectConfiguration().async_snapshot == "blocking"  # today's behaviour by default
    for mode in ("blocking", "overlapped"):
        assert ProjectConfiguration(async_snapshot=mode).async_snapshot == mode


@pytest.mark.parametrize("writer", ["thread", pytest.param("process", marks=_PROCESS)])
def test_overlapped_files_are_byte_identical_to_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    calls: list[int] = []
    original = snapshot._deferred_memmoves
    monkeypatch.setattr(
        snapshot, "_deferred_memmoves", lambda p: (calls.append(len(p)), original(p))
    )
    manifests, deferred = {}, {}
    for mode in ("blocking", "overlapped"):
        acc, model, optimizer, batches = _setup(
            tmp_path / mode, async_writer=writer, async_snapshot=mode
        )
        _step(model, optimizer, batches[0])
        calls.clear()
        torch.manual_seed(5)  # the same RNG state saved by both
        handle = acc.save_state(str(tmp_path / mode / "out"), async_save=True)
        _step(model, optimizer, batches[1])  # training goes on at once (the fence waits)
        handle.result(timeout=120)
        deferred[mode] = len(calls)
        assert acc._checkpoints.background.last_writer == writer
        manifests[mode] = json.loads((tmp_path / mode / "out" / "accelkit.json").read_text())
        acc.end_training()
    # Overlapped: the 256 KiB weight and its AdamW exp_avg, exp_avg_sq copied in the background
    # (the rest, under 64 KiB or not the optimizer's, before save_state returned).
    assert deferred == {"blocking": 0, "overlapped": 3}
    marker = ".accelkit-save.json"
    files = [e for e in manifests["blocking"]["files"] if e["path"] != marker]
    assert files == [e for e in manifests["overlapped"]["files"] if e["path"] != marker]
    for entry in files:
        a = (tmp_path / "blocking" / "out" / entry["path"]).read_bytes()
        b = (tmp_path / "overlapped" / "out" / entry["path"]).read_bytes()
        assert a == b, entry["path"]


@pytest.mark.parametrize("writer", ["thread", pytest.param("process", marks=_PROCESS)])
def test_exact_resume_after_an_overlapped_save_while_training_goes_on(
    tmp_path: Path, writer: str
) -> None:
    acc, model, optimizer, batches = _setup(
        tmp_path, async_writer=writer, async_snapshot="overlapped"
    )
    for batch in batches[:2]:
        _step(model, optimizer, batch)
    at_save = _state(model, optimizer)
    handle = acc.save_state(async_save=True)
    for batch in batches[2:5]:  # each step changes every guarded tensor
        _step(model, optimizer, batch)
    after = _state(model, optimizer)
    assert handle.result(timeout=120).endswith("checkpoint_0")
    assert not torch.equal(after["model.0.weight"], at_save["model.0.weight"])

    acc.load_state()
    _assert_equal(_state(model, optimizer), at_save)  # the values at save time, bit for bit
    for batch in batches[2:5]:
        _step(model, optimizer, batch)
    _assert_equal(_state(model, optimizer), after)
    acc.end_training()


@pytest.mark.slow
@pytest.mark.parametrize("fence", ["step", "wait_for_snapshot", "free_memory", "save_state"])
def test_the_fence_waits_for_the_background_copy(tmp_path: Path, gate: Gate, fence: str) -> None:
    acc, model, optimizer, batches = _setup(
        tmp_path, async_writer="thread", async_snapshot="overlapped"
    )
    _step(model, optimizer, batches[0])
    at_save = _state(model, optimizer)
    handle = acc.save_state(async_save=True)  # returns with the copy held back
    assert gate.entered.wait(30) and not handle.done()
    model(batches[1]).square().mean().backward()  # forward and backward overlap the copy

    calls = {
        "step": optimizer.step,
        "wait_for_snapshot": acc.wait_for_snapshot,
        "free_memory": acc.free_memory,
        "save_state": lambda: acc.save_state(async_save=True),
    }
    worker = threading.Thread(target=calls[fence])
    worker.start()
    worker.join(0.5)
    assert worker.is_alive(), f"{fence} did not wait for the copy"
    assert torch.equal(model[0].weight, at_save["model.0.weight"])
    gate.release()
    worker.join(30)
    assert not worker.is_alive()
    assert handle.result(timeout=60).endswith("checkpoint_0")
    if fence == "step":
        assert not torch.equal(model[0].weight, at_save["model.0.weight"])
        assert optimizer.before_step is None  # cleared: one attribute check per step again
    acc.wait_for_checkpoints()
    if fence != "free_memory":
        acc.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))
        _assert_equal(_state(model, optimizer), at_save)
    acc.end_training()


def test_unguarded_tensors_are_copied_before_save_state_returns(tmp_path: Path, gate: Gate) -> None:
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), async_writer="thread", async_snapshot="overlapped"
        ),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH))
    # model[2] is left out of the optimizer: 256 KiB, but nothing fences its changes.
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    _step(model, optimizer, torch.randn(8, WIDTH))
    at_save = _state(model, optimizer)
    handle = acc.save_state(str(tmp_path / "out"), async_save=True)
    assert gate.entered.wait(30)  # the guarded tensors are still being copied
    model(torch.randn(8, WIDTH)).square().mean().backward()  # changes BatchNorm's statistics
    with torch.no_grad():
        model[2].weight.add_(1.0)  # a parameter no prepared optimizer updates
    assert not torch.equal(model[1].running_mean, at_save["model.1.running_mean"])
    gate.release()
    assert handle.result(timeout=60)  # committed: only guarded tensors are checked
    assert gate.copied == 3  # model[0].weight, its exp_avg and exp_avg_sq
    acc.load_state(str(tmp_path / "out"))
    _assert_equal(_state(model, optimizer), at_save)
    acc.end_training()


@pytest.mark.parametrize("writer", ["thread", pytest.param("process", marks=_PROCESS)])
def test_a_tensor_changed_before_its_copy_fails_the_save(
    tmp_path: Path, gate: Gate, writer: str
) -> None:
    acc, model, optimizer, batches = _setup(
        tmp_path, async_writer=writer, async_snapshot="overlapped"
    )
    _step(model, optimizer, batches[0])
    gate.release()
    acc.save_state(async_save=True).result(timeout=60)  # checkpoint_0, untouched below
    gate.hold()
    handle = acc.save_state(async_save=True)
    assert gate.entered.wait(30)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # outside the optimizer's step, without the fence
    gate.release()
    error = handle.exception(timeout=60)
    assert isinstance(error, CheckpointError)
    text = str(error)
    assert "'0.weight' of model" in text and "not committed" in text
    assert "wait_for_snapshot()" in text and "async_snapshot='blocking'" in text
    # Nothing half-written is ever loaded: the automatic folder is gone, checkpoint_0 stays.
    assert _committed(tmp_path) == ["checkpoint_0"]
    assert not (tmp_path / "checkpoints" / "checkpoint_1").exists()

    # With the fence, the same change is safe and the next save commits.
    handle = acc.save_state(async_save=True)
    acc.wait_for_snapshot()
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    assert handle.result(timeout=60).endswith("checkpoint_2")
    acc.end_training()


@_PROCESS
@pytest.mark.slow
def test_a_killed_writer_with_overlap_fails_its_save_once_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 64 MB of weights: the write lasts long enough to be killed in the middle of it.
    acc, model, optimizer = _accelerator(
        str(tmp_path), width=2048, async_writer="process", async_snapshot="overlapped"
    )
    acc.save_state(async_save=True).result(timeout=120)
    first, folder, _ = _kill_the_writer_mid_save(acc, tmp_path)
    assert _committed(tmp_path) == ["checkpoint_0"] and not folder.exists()

    caplog.set_level(logging.WARNING, logger="accelkit")
    caplog.clear()
    model(torch.randn(2, 2048)).square().mean().backward()
    optimizer.step()  # training goes on
    saved = model[0].weight.detach().clone()
    second = acc.save_state(async_save=True)  # reports the crash (once), does not raise
    model(torch.randn(2, 2048)).square().mean().backward()
    optimizer.step()  # waits for the copy, then changes the weights
    warnings = [r for r in caplog.records if "writer process died" in r.getMessage()]
    assert len(warnings) == 1 and "checkpoint_1" in warnings[0].getMessage()
    assert second.result(timeout=120).endswith("checkpoint_2")
    assert _writer(acc).pid not in (None, first)  # a new writer
    assert not torch.equal(model[0].weight, saved)
    acc.load_state()
    assert torch.equal(model[0].weight, saved)
    acc.end_training()


def _local_sgd_body(project: str) -> dict[str, Any]:
    monkeypatch = pytest.MonkeyPatch()
    gate = Gate(monkeypatch)
    try:
        acc = Accelerator(
            project_config=ProjectConfiguration(
                project_dir=project, async_writer="thread", async_snapshot="overlapped"
            )
        )
        model = nn.Linear(WIDTH, WIDTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = acc.prepare(model, optimizer)
        weight = acc.unwrap_model(model).weight
        with torch.no_grad():
            weight.add_(acc.process_index)  # different weights: averaging changes them
        at_save = weight.detach().clone()
        out = f"{project}/rank{acc.process_index}"
        with LocalSGD(accelerator=acc, model=model, local_sgd_steps=1) as local_sgd:
            handle = acc.save_state(out, async_save=True)
            assert gate.entered.wait(30)
            worker = threading.Thread(target=local_sgd.step)  # averages (through .data)
            worker.start()
            worker.join(0.5)
            waited = worker.is_alive() and torch.equal(weight, at_save)
            gate.release()
            worker.join(60)
        handle.result(timeout=60)
        averaged = not torch.equal(weight, at_save)
        acc.load_state(out)
        restored = torch.equal(weight, at_save)
        acc.end_training()
        return {"waited": waited, "averaged": averaged, "restored": restored}
    finally:
        gate.release()
        monkeypatch.undo()


@pytest.mark.slow
def test_local_sgd_averaging_waits_for_the_background_copy(tmp_path: Path) -> None:
    # LocalSGD writes the averages through .data, which the version check cannot see: only
    # the fence keeps them out of the checkpoint.
    results = run_distributed(_local_sgd_body, str(tmp_path))
    assert results == [{"waited": True, "averaged": True, "restored": True}] * 2


@pytest.mark.parametrize("path", ["data", "numpy", "no_grad_copy", "foreach"])
def test_a_change_through_any_path_before_the_copy_fails_the_save(
    tmp_path: Path, gate: Gate, path: str
) -> None:
    # Writes through .data or numpy() do not move the version counter: before the content
    # check, these saves committed a checkpoint holding the changed weight.
    acc, model, optimizer, batches = _setup(
        tmp_path, async_writer="thread", async_snapshot="overlapped"
    )
    _step(model, optimizer, batches[0])
    weight = model[0].weight
    handle = acc.save_state(async_save=True)
    assert gate.entered.wait(30)  # save_state returned, the copy not started
    if path == "data":
        weight.data.add_(1.0)  # diffusers' EMAModel.copy_to writes through .data too
    elif path == "numpy":
        weight.detach().numpy()[0, :] += 1.0
    elif path == "no_grad_copy":
        with torch.no_grad():
            weight.copy_(weight * 2.0)
    else:
        with torch.no_grad():
            torch._foreach_add_(list(model.parameters()), 1.0)
    gate.release()
    error = handle.exception(timeout=60)
    assert isinstance(error, CheckpointError), "a checkpoint holding the changed weight committed"
    text = str(error)
    assert "'0.weight' of model" in text and "not committed" in text
    assert "wait_for_snapshot()" in text and "async_snapshot='blocking'" in text
    assert _committed(tmp_path) == []
    acc.end_training()


def test_a_change_undone_before_the_copy_commits(tmp_path: Path, gate: Gate) -> None:
    # The check is by content: a tensor changed and restored before its copy is saved as it was.
    acc, model, optimizer, batches = _setup(
        tmp_path, async_writer="thread", async_snapshot="overlapped"
    )
    _step(model, optimizer, batches[0])
    at_save = _state(model, optimizer)
    handle = acc.save_state(async_save=True)
    assert gate.entered.wait(30)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
        model[0].weight.mul_(0.5)  # exact in floating point
    gate.release()
    assert handle.result(timeout=60).endswith("checkpoint_0")
    acc.load_state()
    _assert_equal(_state(model, optimizer), at_save)
    acc.end_training()


@pytest.mark.slow
def test_in_place_updates_right_after_save_never_commit_a_mix(tmp_path: Path) -> None:
    # Issue 37 (7f): the weights changed in place at once after save_state(), racing the
    # background copy (no gate). The version counter missed .data/numpy writes and any
    # operation still running when its tensor's copy ended: 8 of 30 saves committed a mix of
    # old and new weights. Every save must now either fail, naming the tensor, or load back
    # exactly the state at save_state.
    width = 1024  # 4 MiB weights: each copy lasts long enough for the race to happen
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path),
            automatic_checkpoint_naming=True,
            total_limit=1,
            async_writer="thread",  # the process writer writes the same checked snapshot
            async_snapshot="overlapped",
        ),
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(2)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    params = list(model.parameters())
    other = [p.detach() * 0.5 for p in params]  # e.g. EMA weights swapped in for validation

    def data_add() -> None:
        for p in params:
            p.data.add_(0.01)

    def numpy_add() -> None:
        for p in params:
            p.detach().numpy()[...] += 0.01

    def detach_add() -> None:
        for p in params:
            p.detach().add_(0.01)

    def no_grad_copy() -> None:
        with torch.no_grad():
            for p, q in zip(params, other, strict=True):
                p.copy_(q)

    def data_copy() -> None:
        for p, q in zip(params, other, strict=True):
            p.data.copy_(q)

    def raw_step() -> None:  # the wrapped optimizer's step, around the prepared one's fence
        optimizer.optimizer.step()

    updates = [data_add, numpy_add, detach_add, no_grad_copy, data_copy, raw_step]
    outcomes: dict[str, list[str]] = {"committed": [], "failed": [], "mixed": []}
    batch = torch.randn(8, width, generator=torch.Generator().manual_seed(0))
    for i in range(30):
        update = updates[i % len(updates)]
        _step(model, optimizer, batch)
        model(batch).square().mean().backward()  # gradients for raw_step
        at_save = _state(model, optimizer)
        handle = acc.save_state(async_save=True)
        update()  # at once, without wait_for_snapshot()
        error = handle.exception(timeout=120)
        optimizer.zero_grad()
        if error is not None:
            assert isinstance(error, CheckpointError), error
            assert "of model" in str(error) or "optimizer" in str(error), error
            assert "not committed" in str(error) and "wait_for_snapshot()" in str(error)
            outcomes["failed"].append(update.__name__)
            continue
        acc.load_state(handle.path)  # training goes on from the checkpoint
        loaded = _state(model, optimizer)
        mixed = [k for k in at_save if not torch.equal(at_save[k], loaded[k])]
        outcomes["mixed" if mixed else "committed"].append(f"{update.__name__}: {mixed[:3]}")
    acc.end_training()
    assert not outcomes["mixed"], outcomes


def test_without_xxhash_nothing_is_deferred(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: Gate
) -> None:
    # No checksum, no safety net: everything is copied before save_state returns.
    monkeypatch.setattr(snapshot, "MEMORY_DIGEST_AVAILABLE", False)
    acc, model, optimizer, batches = _setup(
        tmp_path, async_writer="thread", async_snapshot="overlapped"
    )
    _step(model, optimizer, batches[0])
    at_save = _state(model, optimizer)
    handle = acc.save_state(async_save=True)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # at once: the copy is already done
    assert handle.result(timeout=60).endswith("checkpoint_0")
    assert gate.copied == 0 and not gate.entered.is_set()
    acc.load_state()
    _assert_equal(_state(model, optimizer), at_save)
    acc.end_training()
