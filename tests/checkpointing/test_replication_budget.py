"""The local disk budget of checkpoints held back for replication (issue #26), against a real
SeaweedFS behind a fault-injecting proxy that keeps the remote tier down."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from accelkit import Accelerator, ProjectConfiguration
from accelkit.errors import ConfigurationError
from tests.checkpointing.test_replication import _committed, _options, _run, _states
from tests.fixtures.s3 import S3Server
from tests.helpers.faultproxy import FaultProxy

pytest.importorskip("s3fs", reason="the remote tier is S3: pip install 'accelkit[s3]'")


def test_disk_budget_deletes_oldest_unreplicated_never_the_newest(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from accelkit.trackers.backends.jsonl import read_jsonl

    remote = s3_server.new_prefix()
    local = tmp_path / "run"
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.down_for(3600)  # the remote tier is down for the whole run
        cfg = ProjectConfiguration(
            project_dir=str(local),
            automatic_checkpoint_naming=True,
            replicate_to=remote,
            storage_options=_options(s3_server, proxy),
            total_limit=1,
        )
        accelerator = Accelerator(project_config=cfg, cpu=True, log_with="jsonl")
        accelerator.init_trackers("run")
        _prepare(accelerator)
        with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing"):
            accelerator.save_state()
            ckpt0 = local / "checkpoints" / "checkpoint_0"
            size = sum(f.stat().st_size for f in ckpt0.iterdir())
            # one and a half checkpoints held back at most
            budget = cfg.replicate_local_budget_bytes = size + size // 2
            for _ in range(4):
                accelerator.save_state()
        # The replicator is stuck listing the remote tier, so nothing is in flight: 4 is the
        # newest, 3 is held back within the budget; 0, 1 and 2 went, oldest first, each as soon
        # as the held-back ones exceeded it.
        assert sorted(_states(str(local), {})) == ["checkpoint_3", "checkpoint_4"]
        replicator = accelerator._checkpoints.replicator
        assert replicator is not None
        assert replicator.dropped() == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
        warnings = [r.getMessage() for r in caplog.records if "before it reached" in r.getMessage()]
        assert len(warnings) == 3  # said once per checkpoint
        for name, line in zip(("checkpoint_0", "checkpoint_1", "checkpoint_2"), warnings):
            assert name in line and f"replicate_local_budget_bytes={budget}" in line
        proxy.up()
        assert accelerator._checkpoints.wait_replicated(60)
        accelerator.end_training()
    # what was kept reached the remote tier; the dropped ones are not claimed to be there
    assert _committed(remote, _options(s3_server)) == ["checkpoint_3", "checkpoint_4"]
    rows = [
        r
        for r in read_jsonl(str(local / "run"))
        if r.get("event") == "checkpoint_replicate"
        and r["values"].get("checkpoint/replication_dropped") == 1
    ]
    assert [r["path"].rsplit("/", 1)[-1] for r in rows] == [
        "checkpoint_0",
        "checkpoint_1",
        "checkpoint_2",
    ]
    # the bytes each freed: its size (a checkpoint's JSON files differ by a few bytes)
    assert all(r["values"]["checkpoint/bytes"] == pytest.approx(size, rel=0.01) for r in rows)


def _prepare(accelerator: Accelerator) -> None:
    import torch
    from torch import nn

    from tests.checkpointing.test_replication import Blob

    torch.manual_seed(0)
    accelerator.prepare(nn.Linear(32, 32))
    accelerator.register_for_checkpointing(Blob(50_000, 0))


def test_disk_budget_zero_holds_nothing_back_but_the_newest(
    s3_server: S3Server, tmp_path: Path
) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.down_for(3600)
        accelerator, _, _ = _run(
            local,
            remote,
            _options(s3_server, proxy),
            total_limit=1,
            replicate_local_budget_bytes=0,
            replicate_deadline_seconds=0.5,
        )
        for _ in range(4):
            accelerator.save_state()
        # the newest stays (never deleted); nothing else is held back
        assert sorted(_states(local, {})) == ["checkpoint_3"]
        left = accelerator._checkpoints.close_replication(0.5)
    assert left == ["checkpoint_3"]


@pytest.mark.parametrize("bad", [-1, 1.5, "10GB", True])
def test_disk_budget_setting_is_checked(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"replicate_local_budget_bytes must be .*e\.g\."):
        ProjectConfiguration(
            project_dir=str(tmp_path),
            replicate_to="memory://r",
            replicate_local_budget_bytes=bad,  # type: ignore[arg-type]
        )


def test_budget_keeps_the_checkpoint_in_flight_and_the_newest(tmp_path: Path) -> None:
    from accelkit.checkpointing.catalog.listing import CheckpointInfo
    from accelkit.checkpointing.catalog.retention import KeepLast
    from accelkit.checkpointing.commit.deletion import HoldBudget, apply_retention
    from accelkit.checkpointing.storage import get_storage

    cfg = ProjectConfiguration(project_dir=str(tmp_path / "run"), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=cfg, cpu=True)
    _prepare(accelerator)
    paths = [accelerator.save_state() for _ in range(5)]
    accelerator.end_training()
    root = str(tmp_path / "run" / "checkpoints")
    size = sum(f.stat().st_size for f in Path(paths[0]).iterdir())
    in_flight = paths[0]  # its copy reads it: release refuses, as the replicator does
    forced: list[CheckpointInfo] = []
    budget = HoldBudget(size + size // 2, lambda p: p != in_flight, forced.append)
    apply_retention(get_storage(root), root, KeepLast(1), paths[4], paths[:4], budget)
    # held back: 0-3 (4 checkpoints, over the budget); 0 stays (in flight), 1-3 go oldest
    # first until the rest fit; 4, the newest, is never a candidate
    assert sorted(_states(str(tmp_path / "run"), {})) == ["checkpoint_0", "checkpoint_4"]
    assert [info.name for info in forced] == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
