"""Per-process checkpoints on 2 real gloo processes (CPU): each process passes ``save_state`` a
folder of its own (a local disk per machine, a temporary folder per process).

Each folder must be a complete committed checkpoint of its own that restores, on the process
that wrote it, the training exactly where the uninterrupted run was: the same remaining batches
of a shuffled stateful dataloader, the same random draws, the same weights. Another process, or
sharded (FSDP) state, is refused with a message naming the folders.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.test_fsdp import TinyLM, _plugin
from tests.helpers.distributed import run_distributed

SAVE_AFTER = 2  # batches trained before the mid-epoch save


def _training(stateful: bool = True) -> tuple[Any, Any, Any, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    from accelkit import Accelerator
    from accelkit.utils import DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = TensorDataset(torch.arange(32), x, x.sum(dim=1, keepdim=True))
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    return acc, model, optimizer, loader


def _weights(acc: Any, model: Any) -> list[float]:
    return [float(v) for p in acc.unwrap_model(model).parameters() for v in p.detach().flatten()]


def _job(base: str) -> dict[str, Any]:
    import random

    import numpy as np

    from accelkit.checkpointing.errors import CheckpointError

    acc, model, optimizer, loader = _training()
    rank = acc.process_index
    torch.manual_seed(100 + rank)  # every process has a random stream of its own
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    folder = os.path.join(base, f"own_{rank}")

    def step(batch: Any) -> tuple[list[int], float, float, float]:
        index, x, y = batch
        noise = torch.rand(1)  # the training consumes each process's random stream
        loss = ((model(x) - y) ** 2).mean() * (1 + noise.item())
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return index.tolist(), noise.item(), random.random(), float(np.random.rand())

    out: dict[str, Any] = {"rank": rank}
    trained = []
    for n, batch in enumerate(loader):
        trained.append(step(batch))
        if n == SAVE_AFTER:
            out["path"] = acc.save_state(folder)
            out["at_save"] = _weights(acc, model)
    out["uninterrupted"] = trained[SAVE_AFTER + 1 :]
    out["final"] = _weights(acc, model)

    out["loaded"] = acc.load_state(folder)
    out["restored"] = _weights(acc, model)
    out["resumed"] = [step(batch) for batch in loader]
    out["final_resumed"] = _weights(acc, model)

    # Every process passes the folder of process 0: process 1 must not take its random states.
    with torch.no_grad():
        acc.unwrap_model(model).weight.zero_()
    try:
        acc.load_state(os.path.join(base, "own_0"))
        out["foreign"] = None
    except CheckpointError as exc:
        out["foreign"] = f"{type(exc).__name__}: {exc}"
    out["weights_after_refusal"] = _weights(acc, model)
    # An asynchronous save (the writer thread's own process group) takes the same course.
    out["async"] = acc.save_state(os.path.join(base, f"async_{rank}"), async_save=True).result()
    return out


def test_each_process_resumes_exactly_from_its_own_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    results = run_distributed(_job, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        folder = tmp_path / f"own_{rank}"
        assert r["path"] == str(folder) and r["loaded"] == str(folder)
        manifest = json.loads((folder / "accelkit.json").read_text())
        files = {f["path"] for f in manifest["files"]}
        assert manifest["process_index"] == rank and manifest["world_size"] == 2
        assert {"model.safetensors", "optimizer.json", "dataloader_0.json"} <= files
        assert f"random_states_{rank}.json" in files
        assert f"random_states_{1 - rank}.json" not in files  # in the other folder
        assert files == {p.name for p in folder.iterdir()} - {"accelkit.json"}
        # The same batches, random draws (torch, Python, NumPy) and weights as without the stop.
        assert len(r["uninterrupted"]) == 16 // 2 - SAVE_AFTER - 1  # 16 samples per process
        assert r["resumed"] == r["uninterrupted"]
        assert r["restored"] == r["at_save"] != r["final"]
        assert r["final_resumed"] == r["final"]
    assert results[0]["uninterrupted"] != results[1]["uninterrupted"]  # per-process streams
    r0, r1 = results
    assert r1["foreign"] is not None and "process 0 saved into a folder of its own" in r1["foreign"]
    assert r0["foreign"] is not None and "failed on process 1" in r0["foreign"]
    for rank, r in enumerate(results):  # refused before anything was restored, on both
        assert r["weights_after_refusal"][:4] == [0.0] * 4
        assert r["async"] == str(tmp_path / f"async_{rank}")
        manifest = json.loads((tmp_path / f"async_{rank}" / "accelkit.json").read_text())
        assert manifest["process_index"] == rank
        assert f"random_states_{rank}.json" in {f["path"] for f in manifest["files"]}

    # On one process: the folder of process 0 restores (with the process-count warning), the
    # folder of process 1 is refused.
    from accelkit.checkpointing.errors import CheckpointError

    acc, model, _, _ = _training()
    with caplog.at_level(logging.WARNING):
        acc.load_state(str(tmp_path / "own_0"))
    assert _weights(acc, model) == r0["at_save"]
    assert "saved by 2 process(es) and this run has 1" in caplog.text
    with pytest.raises(CheckpointError, match="not those of process 0"):
        acc.load_state(str(tmp_path / "own_1"))


def _job_sharded(base: str) -> dict[str, Any]:
    from accelkit import Accelerator
    from accelkit.checkpointing.errors import CheckpointError

    acc = Accelerator(fsdp_plugin=_plugin())
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    try:
        acc.save_state(os.path.join(base, f"own_{acc.process_index}"))
        return {"error": None}
    except CheckpointError as exc:
        return {"error": str(exc)}


def test_sharded_state_into_folders_of_their_own_is_refused(tmp_path: Path) -> None:
    results = run_distributed(_job_sharded, str(tmp_path), timeout=180)
    for r in results:
        assert r["error"] is not None
        assert "sharded (FSDP) state" in r["error"] and "same output_dir" in r["error"]
        assert f"process 0: {tmp_path / 'own_0'}" in r["error"]
        assert f"process 1: {tmp_path / 'own_1'}" in r["error"]
    assert not (tmp_path / "own_1").exists()  # refused before process 1 wrote anything
    assert not (tmp_path / "own_0" / "accelkit.json").exists()
