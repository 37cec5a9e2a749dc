"""Moving over from Hugging Face accelerate mid-run: the continuation is bit for bit the same.

Each case trains with accelerate's own ``Accelerator`` (in fresh processes, 1 or 2 of them, fp32
or bf16 autocast; dropout, AdamW, a LambdaLR warm-up, a registered object, and input noise from
Python's, NumPy's and torch's global generators), saves with its ``save_state`` and continues
3 steps. accelkit then, in fresh processes whose generators are first scrambled, continues from
(a) the same folder through ``load_state(path)`` and (b) what ``accelkit ckpt import`` made of
it: every loss, the learning rate, the registered counter and the batches the stateful
dataloader yields after the save must be exactly accelerate's.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CheckpointMismatchError
from accelkit.cli.main import main as cli
from tests.checkpointing.accelerate_helpers import accelerate_checkpoint, results, run_script


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
    }


@pytest.mark.parametrize(("nproc", "precision"), [(1, "no"), (2, "no"), (1, "bf16"), (2, "bf16")])
def test_continuation_matches_accelerate(
    tmp_path: Path, nproc: int, precision: str, request: pytest.FixtureRequest
) -> None:
    source = tmp_path / "run" / "checkpoints" / "checkpoint_0"
    if precision == "no":  # the session's run of the same script, arguments alike
        suffix = "" if nproc == 1 else f"_{nproc}"
        template = request.getfixturevalue(f"accelerate_checkpoint_template{suffix}")
        accelerate_checkpoint(source.parent, template)
        reference = results(template.parent / "out", nproc)
    else:
        reference = run_script("accelerate", [source], tmp_path / "ref", nproc, precision)
    assert sorted(p.name for p in source.iterdir()) == sorted(
        ["model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"]
        + ["dl_state_dict.bin"]
        + [f"random_states_{r}.pkl" for r in range(nproc)]
    )
    before = _digest(source)
    assert cli(["ckpt", "import", str(source)]) == 0
    imported = source.with_name("checkpoint_1")  # the next free number beside it
    assert _digest(source) == before  # the source is only read

    ours = run_script("accelkit", [source, imported], tmp_path / "ours", nproc, precision)
    for rank in range(nproc):
        expected = reference[rank]["checkpoint_0"]
        assert len(expected["losses"]) == 3
        assert expected["seen"] == 6  # 3 steps before the save, 3 after
        assert expected["batches"][0][0][0] == 4 * (3 * nproc + rank)  # the batch after the save
        assert ours[rank]["checkpoint_0"] == expected, f"load_state(path), rank {rank}"
        assert ours[rank]["checkpoint_1"] == expected, f"load_state(import), rank {rank}"
    if nproc == 2:  # each process got its own generator states back
        assert reference[0]["checkpoint_0"]["losses"] != reference[1]["checkpoint_0"]["losses"]


@pytest.fixture(scope="module")
def accelerate_folder(
    tmp_path_factory: pytest.TempPathFactory, accelerate_checkpoint_template: Path
) -> Path:
    """A real 1-process Accelerate checkpoint (fp32)."""
    return accelerate_checkpoint(tmp_path_factory.mktemp("acc"), accelerate_checkpoint_template)


def test_load_state_without_argument_picks_newest_accelerate_folder(
    tmp_path: Path, accelerate_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.checkpointing.accelerate_run import Counter, build

    checkpoints = tmp_path / "checkpoints"
    for n in (2, 7):
        shutil.copytree(accelerate_folder, checkpoints / f"checkpoint_{n}")
    (checkpoints / "best").mkdir()  # a stray folder is not a checkpoint
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, optimizer, scheduler = build()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    with caplog.at_level(logging.INFO, logger="accelkit"):
        path = accelerator.load_state()
    assert path == str(checkpoints / "checkpoint_7")
    assert counter.seen == 3
    assert scheduler.scheduler.last_epoch == 3  # 3 optimizer steps, 1 process
    assert accelerator.save_iteration == 8  # the next save does not collide
    said = [r.getMessage() for r in caplog.records if "Hugging Face accelerate" in r.getMessage()]
    assert len(said) == 1 and "checkpoint_7" in said[0], said
    # Weights are exactly those accelerate saved.
    from safetensors.torch import load_file

    saved = load_file(str(accelerate_folder / "model.safetensors"))
    for name, tensor in accelerator.unwrap_model(model).state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_mismatched_objects_are_refused_before_anything_changes(
    accelerate_folder: Path,
) -> None:
    from tests.checkpointing.accelerate_run import build

    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = build()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # No registered object, but the folder holds custom_checkpoint_0.pkl.
    with pytest.raises(CheckpointMismatchError, match="registered object"):
        accelerator.load_state(str(accelerate_folder))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed by a refused load"


def test_sharded_fsdp_save_is_refused_with_the_fix(tmp_path: Path, accelerate_folder: Path) -> None:
    from tests.checkpointing.accelerate_run import Counter, build

    folder = tmp_path / "checkpoint_0"
    shutil.copytree(accelerate_folder, folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model_fsdp_0").mkdir()  # what accelerate writes for a sharded FSDP model
    (folder / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"x")
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = build()
    accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    with pytest.raises(CheckpointMismatchError, match="FULL_STATE_DICT") as info:
        accelerator.load_state(str(folder))
    assert "pytorch_model_fsdp_0" in str(info.value)
