"""Retention never leaves a project without a checkpoint that verifies (issue 23, item 1).

The attack: a flipped byte in the newest checkpoint's weights (the manifest is *not* re-signed,
so ``ckpt verify`` says FAIL while ``ls``, which checks sizes only, says committed). Before the
fix ``accelkit ckpt prune --keep 1 --yes`` kept that damaged checkpoint and deleted the older
intact one, and no run could resume. Now prune checks the checksums of what it would keep: a
damaged checkpoint is kept but not counted, the newest intact one stays, and ``load_state()``
skips the damaged one (with a warning) and restores the intact one. The neighbours: another
file type damaged (the optimizer state), the damage in the middle of the kept ones, every
checkpoint damaged, ``--dry-run``, ``--keep-every``/``--keep-best`` beside ``--keep``, and
training's own retention after resuming past a damaged checkpoint.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog.retention import KeepBest, KeepEvery, KeepLast, plan_retention

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
ACCELKIT = Path(sys.executable).with_name("accelkit")  # the installed console script


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _accelerator(project: Path, **config: object) -> tuple[Accelerator, nn.Module]:
    cfg = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, **config)
    accelerator = Accelerator(project_config=cfg, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save(project: Path, count: int, **config: object) -> list[dict[str, torch.Tensor]]:
    """``count`` checkpoints, each after setting the weights to its number: which one a load
    restored shows in the weights."""
    accelerator, model = _accelerator(project, **config)
    saved = []
    for i in range(count):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i + 1))
        accelerator.save_state(metrics={"loss": 1.0 / (i + 1)})
        saved.append(_weights(model))
    return saved


def _ckpt(project: Path, n: int) -> Path:
    return project / "checkpoints" / f"checkpoint_{n}"


def _flip_byte(path: Path) -> None:
    """Flip the last byte of ``path`` (inside the tensor data): same size, other checksum."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _accelkit(*args: str) -> subprocess.CompletedProcess[str]:
    """The real ``accelkit`` console script, importing this checkout's package."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [str(ACCELKIT), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def _plan_rows(out: str) -> list[str]:
    """The rows of the plan table (between its title and ``Kept:``)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    end = next(i for i, line in enumerate(lines) if line.startswith("Kept:"))
    return lines[start + 1 : end]


def _names(project: Path) -> list[str]:
    return sorted(p.name for p in (project / "checkpoints").iterdir())


def test_prune_keeps_the_newest_intact_checkpoint_and_resume_loads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    project = tmp_path / "project"
    saved = _save(project, 3)
    _flip_byte(_ckpt(project, 2) / "model.safetensors")
    # The attack's premise: verify fails it, ls (sizes only) still calls it committed.
    assert _accelkit("ckpt", "verify", str(project)).returncode == 1
    assert "committed" in _accelkit("ckpt", "ls", str(project)).stdout.splitlines()[3]

    dry = _accelkit("ckpt", "prune", str(project), "--keep", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert _names(project) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert "checkpoint_0" in dry.stdout and "Kept: checkpoint_1, checkpoint_2" in dry.stdout
    assert "Keeping damaged checkpoint_2" in dry.stderr and "model.safetensors" in dry.stderr

    pruned = _accelkit("ckpt", "prune", str(project), "--keep", "1", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert _plan_rows(pruned.stdout) == _plan_rows(dry.stdout) != []  # --dry-run told the truth
    assert "Removed checkpoint_0" in pruned.stdout
    assert "Keeping damaged checkpoint_2" in pruned.stderr
    assert _names(project) == ["checkpoint_1", "checkpoint_2"]  # the damaged one is not deleted
    assert _accelkit("ckpt", "verify", str(_ckpt(project, 1))).returncode == 0

    accelerator, model = _accelerator(project)
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        accelerator.load_state()
    restored = model.state_dict()
    assert all(torch.equal(restored[k], saved[1][k]) for k in restored), "not checkpoint_1"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint_2" in m and "damaged" in m for m in warned), warned
    # The next save does not reuse the damaged checkpoint's number.
    assert accelerator.save_state().endswith("checkpoint_3")


def test_prune_counts_past_damage_in_the_middle_and_in_other_files(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _save(project, 5)
    _flip_byte(_ckpt(project, 3) / "random_states_0.safetensors")  # not the weights
    pruned = _accelkit("ckpt", "prune", str(project), "--keep", "2", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    # Two intact ones kept (4 and 2), the damaged 3 kept beside them, 0 and 1 gone.
    assert _names(project) == ["checkpoint_2", "checkpoint_3", "checkpoint_4"]
    assert "Keeping damaged checkpoint_3 (random_states_0.safetensors" in pruned.stderr
    for n in (2, 4):
        assert _accelkit("ckpt", "verify", str(_ckpt(project, n))).returncode == 0


def test_prune_with_every_checkpoint_damaged_deletes_none_of_them(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _save(project, 3)
    for n in range(3):
        _flip_byte(_ckpt(project, n) / "model.safetensors")
    pruned = _accelkit("ckpt", "prune", str(project), "--keep", "1", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert _names(project) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert "No committed checkpoint verifies" in pruned.stderr
    assert pruned.stderr.count("Keeping damaged") == 3


def test_prune_extra_rules_never_count_a_damaged_checkpoint(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _save(project, 5)  # loss 1/(i+1): the newest is the best
    _flip_byte(_ckpt(project, 4) / "model.safetensors")
    _flip_byte(_ckpt(project, 2) / "model.safetensors")
    pruned = _accelkit(
        "ckpt", "prune", str(project), "--keep", "1", "--keep-best", "1", "--metric", "loss",
        "--keep-every", "2", "--yes",
    )  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    # --keep 1: 3 (4 damaged); best: 3 as well (4 damaged); every 2nd: 0 (2 and 4 damaged).
    assert _names(project) == ["checkpoint_0", "checkpoint_2", "checkpoint_3", "checkpoint_4"]


def test_training_retention_after_resuming_past_damage_keeps_a_loadable_checkpoint(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    _save(project, 3)
    _flip_byte(_ckpt(project, 2) / "model.safetensors")
    accelerator, model = _accelerator(project, total_limit=1)
    accelerator.load_state()  # skips checkpoint_2, loads checkpoint_1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    new = accelerator.save_state()
    assert new.endswith("checkpoint_3")
    # Retention ran after the commit: the new checkpoint (verified from the bytes it wrote)
    # is what total_limit=1 keeps, and it verifies and loads.
    assert _names(project) == ["checkpoint_3"]
    assert _accelkit("ckpt", "verify", str(project)).returncode == 0
    other, fresh = _accelerator(project)
    other.load_state()
    assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in fresh.state_dict().values())


# ---------------------------------------------------------------- the shared plan, without a disk


@dataclass(frozen=True)
class _C:
    name: str
    iteration: int
    created: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    state: str = "committed"
    is_automatic: bool = True
    size_bytes: int = 0


def _plan(
    damaged: set[int], policy: object, count: int = 6
) -> tuple[list[int], list[int], list[int]]:
    asked: list[int] = []

    def damage(c: _C) -> str | None:
        asked.append(c.iteration)
        return "flipped" if c.iteration in damaged else None

    ckpts = [_C(f"checkpoint_{i}", i, metrics={"loss": float(i)}) for i in range(count)]
    plan = plan_retention(ckpts, policy, damage)  # type: ignore[arg-type]
    assert len(asked) == len(set(asked)), "a checkpoint was checked twice"
    return [c.iteration for c in plan.delete], [c.iteration for c, _ in plan.damaged], asked


def test_plan_checks_only_what_it_keeps_and_replaces_damaged_ones() -> None:
    deleted, damaged, asked = _plan({5, 4}, KeepLast(2))
    assert deleted == [0, 1] and damaged == [4, 5]  # 2 and 3 kept in their place
    assert sorted(asked) == [2, 3, 4, 5]  # the deleted ones are never read
    deleted, damaged, asked = _plan(set(), KeepLast(2))
    assert deleted == [0, 1, 2, 3] and damaged == [] and sorted(asked) == [4, 5]


def test_plan_never_deletes_the_newest_intact_checkpoint() -> None:
    ckpts = [_C(f"checkpoint_{i}", i, metrics={"loss": float(i)}) for i in range(6)]
    # KeepEvery(4) alone keeps 0 and 4; 5 is the newest and intact: protected.
    plan = plan_retention(ckpts, KeepEvery(4), lambda c: None)
    assert plan.protected is ckpts[5] and [c.iteration for c in plan.delete] == [1, 2, 3]
    # KeepBest(1, loss) keeps 0; 5 damaged, so 4 is the newest intact and protected.
    plan = plan_retention(ckpts, KeepBest(1, "loss"), lambda c: "bad" if c.iteration == 5 else None)
    assert plan.protected is ckpts[4] and plan.intact is ckpts[4]
    assert [c.iteration for c in plan.delete] == [1, 2, 3]
    assert [c.iteration for c, _ in plan.damaged] == [5]
