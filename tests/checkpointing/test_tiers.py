"""The manager knows one tier; further tiers compose through its ``Tier`` hooks (issue #38):
a commit observer per save, what retention holds back, and the resolve of ``load_state()``.
A tier written here, with no replication at all, drives all three."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.commit.deletion import HoldBudget
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.manager import Tier
from accelkit.checkpointing.objects.contents import TrainingObjects
from accelkit.checkpointing.restore.sequence import LoadResult, LoadSequence
from accelkit.checkpointing.tiered import TieredCheckpointManager


class RecordingTier:
    """Observes commits, holds one folder back from retention, and resolves loads from a
    folder of its own when it has one."""

    def __init__(self) -> None:
        self.asked: list[bool] = []
        self.committed: list[tuple[str, int]] = []
        self.held: set[str] = set()
        self.own: str | None = None

    def observer(self, automatic: bool) -> Callable[[str, Manifest], None] | None:
        self.asked.append(automatic)
        if not automatic:
            return None
        return lambda target, manifest: self.committed.append((target, manifest.iteration))

    def hold(self) -> tuple[Collection[str], HoldBudget | None]:
        return self.held, None

    def resolve(
        self, sequence: LoadSequence, objects: TrainingObjects, local: Callable[[], LoadResult]
    ) -> LoadResult:
        return local() if self.own is None else sequence.run(self.own, objects)


def _accelerator(tmp_path: Path) -> tuple[Accelerator, torch.nn.Module, RecordingTier]:
    config = ProjectConfiguration(
        project_dir=str(tmp_path / "run"), automatic_checkpoint_naming=True, total_limit=1
    )
    accelerator = Accelerator(project_config=config, cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    tier = RecordingTier()
    manager = accelerator._checkpoints
    assert isinstance(manager, TieredCheckpointManager)
    manager.add_tier(tier)
    checked: Tier = tier  # the protocol, as a type checker sees it
    assert checked is tier
    return accelerator, model, tier


def test_a_tier_observes_commits_and_holds_back_from_retention(tmp_path: Path) -> None:
    accelerator, _, tier = _accelerator(tmp_path)
    first = accelerator.save_state()
    tier.held = {first}
    accelerator.save_state()
    accelerator.save_state()
    accelerator.save_state(str(tmp_path / "named"))  # named: asked, no observer
    assert tier.asked == [True, True, True, False]
    assert [n for _, n in tier.committed] == [0, 1, 2]
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    # total_limit=1 keeps checkpoint_2; the tier held checkpoint_0 back
    assert names == ["checkpoint_0", "checkpoint_2"]


def test_a_tier_resolves_a_load_without_a_folder(tmp_path: Path) -> None:
    accelerator, model, tier = _accelerator(tmp_path)
    accelerator.save_state()
    with torch.no_grad():
        model.weight.fill_(3.0)
    own = accelerator.save_state(str(tmp_path / "elsewhere"))
    with torch.no_grad():
        model.weight.fill_(0.0)
    assert accelerator.load_state().endswith("checkpoint_0")  # the tier falls through
    tier.own = own
    assert accelerator.load_state() == own  # the tier's own folder, through the same sequence
    assert torch.all(model.weight == 3.0)


def test_the_manager_knows_one_tier() -> None:
    """Replication stays in its room and the tiered manager: ``manager.py`` never names it."""
    import accelkit.checkpointing.manager as manager

    source = Path(manager.__file__).read_text(encoding="utf-8").lower()
    assert "replicat" not in source
