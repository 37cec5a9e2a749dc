"""examples/boilerplate (the guide's Hydra boilerplate): 2 processes, then a mid-epoch resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.examples.runner import launch, read_jsonl

pytest.importorskip(
    "hydra", reason="the boilerplate needs hydra-core: pip install 'accelkit[examples]'"
)
pytest.importorskip(
    "torchdata", reason="the boilerplate needs torchdata: pip install 'accelkit[examples]'"
)
pytest.importorskip(
    "transformers", reason="the boilerplate needs transformers: pip install 'accelkit[examples]'"
)

# 256 samples / 2 processes / batch 16 = 8 batches per epoch, 2 epochs = 16 optimizer steps.
# Dropout stays on (0.1): the resumed run must still match the first one bit for bit, which
# holds only if resuming consumes exactly the random numbers the first run did.
OVERRIDES = [
    "num_epochs=2",
    "data.num_train_samples=256",
    "data.num_val_samples=64",
    "data.batch_size=16",
    "checkpoint_steps=5",
    "eval_steps=8",
    "scheduler.num_warmup_steps=4",
]


def _train_records(run_dir: Path) -> dict[int, dict[str, float]]:
    records = read_jsonl(run_dir / "boilerplate" / "metrics.jsonl")
    return {r["step"]: r["values"] for r in records if "loss" in r["values"]}


def test_boilerplate_trains_and_resumes_mid_epoch(tmp_path: Path) -> None:
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first = launch("boilerplate/train.py", f"hydra.run.dir={first_dir}", *OVERRIDES, cwd=tmp_path)
    output = first.stdout + first.stderr
    assert "Saved" in output and "Final validation" in output
    # Step checkpoints every 5 optimizer steps, each committed (manifest present).
    saved = sorted(p.name for p in first_dir.glob("step_*"))
    assert saved == ["step_10", "step_15", "step_5"]
    for name in saved:
        manifest = json.loads((first_dir / name / "accelkit.json").read_text())
        assert manifest["world_size"] == 2
    # save_model wrote loadable safetensors weights.
    weights = load_file(str(first_dir / "model" / "model.safetensors"))
    assert any(key.endswith("weight") for key in weights)
    # Hyperparameters (the whole Hydra config) reached the tracker.
    config = json.loads((first_dir / "boilerplate" / "config.json").read_text())
    assert config["num_epochs"] == 2 and config["data"]["batch_size"] == 16

    first_steps = _train_records(first_dir)
    assert sorted(first_steps) == list(range(1, 17))
    # Warm-up then cosine decay, counted in optimizer steps although the prepared scheduler
    # advances once per process (the seed multiplied num_warmup_steps, which was None).
    lrs = [first_steps[s]["learning_rate"] for s in range(1, 17)]
    assert lrs[3] == pytest.approx(1e-3) and lrs[0] < lrs[3] and lrs[-1] == pytest.approx(0.0)

    # Resume from step 5: batch 5 of the 8 of epoch 1, so the dataloader must restart mid-epoch.
    second = launch(
        "boilerplate/train.py",
        f"hydra.run.dir={second_dir}",
        f"resume_from_checkpoint={first_dir / 'step_5'}",
        *OVERRIDES,
        cwd=tmp_path,
    )
    output = second.stdout + second.stderr
    assert f"Resumed from checkpoint: {first_dir / 'step_5'}" in output
    assert "Resuming from epoch 1, step 5" in output
    second_steps = _train_records(second_dir)
    assert sorted(second_steps) == list(range(6, 17))
    # Same data order, weights, optimizer and scheduler state: the same losses and rates.
    for step in range(6, 17):
        assert second_steps[step]["loss"] == pytest.approx(first_steps[step]["loss"], rel=1e-6)
        assert second_steps[step]["learning_rate"] == pytest.approx(
            first_steps[step]["learning_rate"]
        )
        assert second_steps[step]["epoch"] == first_steps[step]["epoch"]
    # Its own step checkpoints continue the numbering of optimizer steps.
    assert sorted(p.name for p in second_dir.glob("step_*")) == ["step_10", "step_15"]
