"""examples/quickstart.py, the README's main job: 2 processes, then a second run that resumes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.examples.runner import launch, read_jsonl

# 256 samples / 2 processes / batch 16 = 8 steps per epoch: seconds on 2 cores.
TINY = ["--samples", "256", "--batch_size", "16"]
STEPS_PER_EPOCH = 8


def test_quickstart_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    project = tmp_path / "run"
    checkpoints = project / "checkpoints"

    first = launch(
        "quickstart.py", "--project_dir", str(project), "--epochs", "1", *TINY, cwd=tmp_path
    )
    assert "resumed from" not in first.stdout
    assert f"saved {checkpoints / 'checkpoint_0'}" in first.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0"]

    second = launch(
        "quickstart.py",
        "--project_dir",
        str(project),
        "--epochs",
        "3",
        "--keep",
        "2",
        *TINY,
        cwd=tmp_path,
    )
    # It says where it resumed from, and at which epoch/step.
    resumed = f"resumed from {checkpoints / 'checkpoint_0'} (epoch 1, step {STEPS_PER_EPOCH})"
    assert resumed in second.stdout, second.stdout
    assert "epoch 1:" not in second.stdout  # the finished epoch is not trained again
    assert f"done: 3 epochs, {3 * STEPS_PER_EPOCH} steps" in second.stdout
    # Numbering continued after the loaded checkpoint and total_limit=2 kept the newest two.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    manifest = json.loads((checkpoints / "checkpoint_2" / "accelkit.json").read_text())
    assert manifest["world_size"] == 2
    assert manifest["iteration"] == 2
    assert "loss" in manifest["metrics"]

    # One metrics file across both runs: every step exactly once (main process only), and
    # the second run continued at the step after the checkpoint, not from 1.
    records = read_jsonl(project / "quickstart" / "metrics.jsonl")
    steps = [r["step"] for r in records if "train/loss" in r["values"]]
    assert steps == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    epoch_losses = [r["values"]["epoch/loss"] for r in records if "epoch/loss" in r["values"]]
    assert len(epoch_losses) == 3
    assert epoch_losses[-1] < epoch_losses[0]  # it learns
    # TensorBoard wrote an event file in each run.
    assert len(list((project / "quickstart").glob("events.out.tfevents.*"))) == 2
