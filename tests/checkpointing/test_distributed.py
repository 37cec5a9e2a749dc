"""The commit protocol on 2 real processes (gloo): rank files, one commit, failures, RNG."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributed import run_distributed


def _job(project: str) -> dict[str, Any]:
    import torch
    from torch import nn

    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.checkpointing.errors import CheckpointError

    acc = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, total_limit=2
        )
    )
    rank = acc.process_index
    torch.manual_seed(100 + rank)  # every process has its own generator state
    model = acc.prepare(nn.Linear(3, 3))
    out: dict[str, Any] = {"rank": rank}
    out["path0"] = acc.save_state()
    out["after_save"] = torch.rand(2)

    def fail_on_rank_1(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if rank == 1:
            raise RuntimeError("disk on fire")

    handle = acc.register_save_state_pre_hook(fail_on_rank_1)
    try:
        acc.save_state()
        out["failure"] = None
    except (CheckpointError, RuntimeError) as exc:
        out["failure"] = f"{type(exc).__name__}: {exc}"
    handle.remove()
    out["path_after_failure"] = acc.save_state()  # the next save works and is numbered on

    acc.save({"rank": rank}, os.path.join(project, f"saved_by_{rank}.pt"))
    with torch.no_grad():
        model.module.weight.zero_() if hasattr(model, "module") else model.weight.zero_()
    out["loaded"] = acc.load_state(out["path0"])
    out["after_load"] = torch.rand(2)
    out["weight_sum"] = float(acc.unwrap_model(model).weight.abs().sum())
    out["iteration"] = acc.save_iteration
    return out


@pytest.mark.slow
def test_two_processes_commit_once_with_every_rank_file(tmp_path: Any) -> None:
    project = str(tmp_path)
    r0, r1 = run_distributed(_job, project, world_size=2)
    path0 = r0["path0"]
    assert path0 == r1["path0"] and path0.endswith("checkpoint_0")
    manifest = json.loads(Path(os.path.join(path0, "accelkit.json")).read_text())
    files = [f["path"] for f in manifest["files"]]
    assert "random_states_0.json" in files and "random_states_1.json" in files
    assert manifest["world_size"] == 2 and "model.safetensors" in files

    assert r0["failure"] is not None and "failed on process 1" in r0["failure"]
    assert r1["failure"] is not None and "disk on fire" in r1["failure"]
    assert not os.path.exists(os.path.join(project, "checkpoints", "checkpoint_1"))
    assert r0["path_after_failure"].endswith("checkpoint_2")
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == [
        "checkpoint_0",
        "checkpoint_2",
    ]

    assert sorted(n for n in os.listdir(project) if n.startswith("saved_by")) == ["saved_by_0.pt"]
    for r in (r0, r1):
        assert r["loaded"] == path0
        assert r["weight_sum"] > 0  # weights restored from the checkpoint
        assert r["iteration"] == 3
        assert (r["after_load"] == r["after_save"]).all()  # each rank's own RNG state
    assert not (r0["after_save"] == r1["after_save"]).all()
