"""Asynchronous saves of sharded (FSDP2) state, on 2 real gloo processes (CPU).

One job checks everything (2-process FSDP jobs take tens of seconds on 2 cores): training goes
on while the sharded write is held back, the checkpoint holds the state at the call, resuming
from it replays the same steps bit for bit, and a storage failure on one process surfaces on
every process without committing anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accelkit.checkpointing.formats.manifest import read_manifest
from accelkit.checkpointing.storage import get_storage
from tests.distributed.test_fsdp import STEPS, VOCAB, TinyLM, _data, _full_params, _plugin
from tests.helpers.distributed import run_distributed


def _job_async_sharded(project_dir: str) -> dict[str, Any]:
    import threading

    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.checkpointing.commit import snapshot
    from accelkit.checkpointing.errors import CheckpointError
    from accelkit.checkpointing.sharded import _dcp_storage

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gate = threading.Event()
    real_write = snapshot.write_sharded

    def gated(*args: Any, **kwargs: Any) -> Any:  # the sharded write waits for the test
        if not gate.wait(120):
            raise TimeoutError("gate never opened")
        return real_write(*args, **kwargs)

    snapshot.write_sharded = gated  # type: ignore[assignment]
    config = ProjectConfiguration(project_dir, automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(fsdp_plugin=_plugin(), project_config=config)
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = _data()
    share = data.shape[1] // world

    def step(i: int) -> None:
        batch = data[i % STEPS, rank * share : (rank + 1) * share]
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    out: dict[str, Any] = {}
    step(0)
    out["at_call"] = _full_params(model)
    handle = accelerator.save_state(async_save=True)
    step(1)  # training collectives on the default group while the writer is held back
    step(2)
    out["pending_while_training"] = not handle.done()
    out["after"] = _full_params(model)
    gate.set()
    # Collectives of the training loop run while the writer's DCP collectives do: they must
    # neither mix nor wait for each other.
    sums = [accelerator.reduce(torch.tensor(float(i + rank)), "sum").item() for i in range(50)]
    out["sums_ok"] = sums == [float(2 * i + 1) for i in range(50)]
    out["path"] = handle.result(timeout=120)

    accelerator.load_state(out["path"])
    out["loaded"] = _full_params(model)
    step(1)  # the optimizer state came back too: the same two steps give the same weights
    step(2)
    out["replayed"] = _full_params(model)

    if rank == 1:  # this process's storage fails in the middle of DCP's write

        def broken(self: Any, path: Any, mode: str) -> Any:
            raise OSError(f"disk full (injected) writing {path}")

        _dcp_storage.StorageFileSystem.create_stream = broken  # type: ignore[method-assign]
    failed = accelerator.save_state(async_save=True)
    try:
        accelerator.wait_for_checkpoints()
        out["error"] = None
    except CheckpointError as exc:
        out["error"] = str(exc)
    out["failed_path"] = failed.path
    out["failed_exists"] = os.path.exists(failed.path)
    return out


def test_async_save_of_sharded_state(tmp_path: Path) -> None:
    project = str(tmp_path / "run")
    r0, r1 = run_distributed(_job_async_sharded, project, world_size=2, timeout=300)
    assert r0["pending_while_training"] and r1["pending_while_training"]
    assert r0["sums_ok"] and r1["sums_ok"]
    assert r0["path"] == r1["path"] == f"{project}/checkpoints/checkpoint_0"
    # The checkpoint holds the weights at the call, not the ones trained while it was written.
    assert set(r0["loaded"]) == set(r0["at_call"])
    assert any(not torch.equal(r0["at_call"][k], r0["after"][k]) for k in r0["at_call"])
    for name, value in r0["at_call"].items():
        assert torch.equal(r0["loaded"][name], value), name
        assert torch.equal(r0["replayed"][name], r0["after"][name]), name
    manifest = read_manifest(get_storage(project), r0["path"])
    assert manifest is not None and manifest.world_size == 2
    listed = {e.path for e in manifest.files}
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= listed
    assert not any(p.startswith(("model", "optimizer")) for p in listed)
    # A failure on process 1 fails the save on both; nothing is committed.
    assert r1["error"] is not None and "disk full (injected)" in r1["error"]
    assert r0["error"] is not None and "was not committed" in r0["error"]
    assert "process 1: OSError: disk full (injected)" in r0["error"]  # DCP tells everyone
    assert r0["failed_path"].endswith("checkpoint_1") and not r0["failed_exists"]
