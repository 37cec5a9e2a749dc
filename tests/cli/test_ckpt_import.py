"""``accelkit ckpt import SRC [DST]`` on a real Hugging Face accelerate checkpoint.

The source is written by accelerate's own ``save_state`` (in a subprocess, 2 processes); the
command runs in-process through ``accelkit.cli.main.main``. What is checked: the result is a
committed checkpoint that ``ckpt verify`` accepts, holding the same weights, optimizer,
scheduler, registered object and both processes' random states; ``--json``; the default
destination; exit codes 0/1/2; an fsspec URL (``memory://``); the source is never modified;
``ckpt ls`` shows the source as ``accelerate`` and ``ckpt prune`` keeps it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import fsspec
import pytest
import torch

from accelkit.checkpointing.formats.manifest import read_manifest
from accelkit.checkpointing.formats.safetensors_io import read_safetensors
from accelkit.checkpointing.formats.state_io import read_state
from accelkit.checkpointing.interop.accelerate_pickle import load_pickle
from accelkit.checkpointing.storage import get_storage
from accelkit.checkpointing.storage.confined import confine
from accelkit.cli.main import main
from tests.checkpointing.accelerate_helpers import accelerate_checkpoint


@pytest.fixture(scope="module")
def accelerate_run(
    tmp_path_factory: pytest.TempPathFactory, accelerate_checkpoint_template_2: Path
) -> Path:
    """A project whose ``checkpoints/checkpoint_0`` accelerate wrote with 2 processes."""
    root = tmp_path_factory.mktemp("acc2")
    accelerate_checkpoint(root / "checkpoints", accelerate_checkpoint_template_2)
    return root


@pytest.fixture
def project(tmp_path: Path, accelerate_run: Path) -> Path:
    shutil.copytree(accelerate_run / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
    }


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_import_is_committed_verified_and_holds_the_same_state(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    before = _digest(src)
    code, out, err = _cli(capsys, "ckpt", "import", str(src), "--json")
    assert code == 0, err
    doc = json.loads(out)
    dst = project / "checkpoints" / "checkpoint_1"
    assert doc["destination"] == str(dst)
    assert doc["state"] == "committed" and doc["verified"] is True
    assert doc["world_size"] == 2 and doc["iteration"] == 1
    assert _digest(src) == before

    code, out, _ = _cli(capsys, "ckpt", "verify", str(dst))
    assert code == 0 and "1 of 1 checkpoint(s) intact" in out
    code, out, _ = _cli(capsys, "ckpt", "ls", str(project), "--json")
    states = {row["name"]: row["state"] for row in json.loads(out)}
    assert states == {"checkpoint_0": "accelerate", "checkpoint_1": "committed"}

    storage = get_storage(str(dst))
    manifest = read_manifest(storage, str(dst))
    assert manifest is not None
    assert manifest.metadata["imported_from"] == str(src)
    src_view = confine(get_storage(str(src)), str(src))
    weights, _ = read_safetensors(storage, str(dst / "model.safetensors"))
    theirs, _ = read_safetensors(src_view, str(src / "model.safetensors"))
    assert weights.keys() == theirs.keys()
    assert all(torch.equal(weights[k], theirs[k]) for k in weights)
    optimizer = read_state(storage, str(dst), "optimizer")
    original = load_pickle(src_view, str(src / "optimizer.bin"))
    assert optimizer["param_groups"] == original["param_groups"]
    for pid, state in original["state"].items():
        assert int(state["step"]) == int(optimizer["state"][pid]["step"])
        assert torch.equal(state["exp_avg"], optimizer["state"][pid]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], optimizer["state"][pid]["exp_avg_sq"])
    assert read_state(storage, str(dst), "scheduler") == load_pickle(
        src_view, str(src / "scheduler.bin")
    )
    assert read_state(storage, str(dst), "custom_checkpoint_0") == {"seen": 3}
    for rank in (0, 1):
        rng = read_state(storage, str(dst), f"random_states_{rank}")
        theirs_rng = load_pickle(src_view, str(src / f"random_states_{rank}.pkl"))
        assert rng["python"] == theirs_rng["random_state"]
        assert (rng["numpy"][1] == theirs_rng["numpy_random_seed"][1]).all()
        assert rng["numpy"][2:] == theirs_rng["numpy_random_seed"][2:]
        assert torch.equal(rng["torch"], theirs_rng["torch_manual_seed"])


def test_explicit_destination_and_text_output(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    dst = tmp_path / "elsewhere" / "imported"
    code, out, err = _cli(capsys, "ckpt", "import", str(src), str(dst))
    assert code == 0, err
    assert "committed and verified" in out and str(dst) in out
    manifest = read_manifest(get_storage(str(dst)), str(dst))
    assert manifest is not None and manifest.iteration is None  # not a checkpoint_<n> name


def test_exit_codes(project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    # 2: the destination exists (nothing is written over it).
    taken = tmp_path / "taken"
    taken.mkdir()
    code, _, err = _cli(capsys, "ckpt", "import", str(src), str(taken))
    assert code == 2 and "already exists" in err and str(taken) in err
    assert list(taken.iterdir()) == []
    # 2: no such source.
    code, _, err = _cli(capsys, "ckpt", "import", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in err
    # 1: the source is not an accelerate checkpoint (a committed accelkit one, a user folder).
    code, _, _ = _cli(capsys, "ckpt", "import", str(src))
    assert code == 0
    for other in (project / "checkpoints" / "checkpoint_1", tmp_path / "notes"):
        other.mkdir(exist_ok=True)
        if other.name == "notes":
            (other / "a.txt").write_text("mine")
        code, _, err = _cli(capsys, "ckpt", "import", str(other), str(tmp_path / "x"))
        assert code == 1, err
        assert "not a checkpoint written by Hugging Face accelerate" in err and str(other) in err
        assert not (tmp_path / "x").exists()


def test_import_from_and_to_an_fsspec_url(
    accelerate_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fs = fsspec.filesystem("memory")
    base = "memory://import-test/checkpoints"
    for path in (accelerate_run / "checkpoints" / "checkpoint_0").iterdir():
        fs.pipe(f"{base}/checkpoint_4/{path.name}", path.read_bytes())
    try:
        code, out, err = _cli(capsys, "ckpt", "import", f"{base}/checkpoint_4", "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["destination"].endswith("checkpoints/checkpoint_5")
        code, out, _ = _cli(capsys, "ckpt", "verify", doc["destination"])
        assert code == 0, out
    finally:
        fs.rm("/import-test", recursive=True)


def test_prune_keeps_accelerate_folders(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    before = _digest(src)
    for _ in range(2):  # checkpoint_1 and checkpoint_2, both committed
        assert _cli(capsys, "ckpt", "import", str(src))[0] == 0
    code, out, _ = _cli(capsys, "ckpt", "prune", str(project), "--keep", "1", "--yes")
    assert code == 0, out
    left = sorted(p.name for p in (project / "checkpoints").iterdir())
    assert left == ["checkpoint_0", "checkpoint_2"]
    assert _digest(src) == before


def test_pickled_weights_and_grad_scaler_are_imported(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``save_state(safe_serialization=False)`` writes ``pytorch_model.bin`` (``torch.save`` of
    the state dict); fp16 runs write ``scaler.pt`` (``torch.save`` of the scaler's state)."""
    from safetensors.torch import load_file

    src = project / "checkpoints" / "checkpoint_0"
    weights = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    torch.save(weights, src / "pytorch_model.bin")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    torch.save(scaler.state_dict(), src / "scaler.pt")
    code, out, err = _cli(capsys, "ckpt", "import", str(src), "--json")
    assert code == 0, err
    dst = Path(json.loads(out)["destination"])
    storage = get_storage(str(dst))
    imported, _ = read_safetensors(storage, str(dst / "model.safetensors"))
    assert imported.keys() == weights.keys()
    assert all(torch.equal(imported[k], weights[k]) for k in weights)
    assert read_state(storage, str(dst), "scaler") == scaler.state_dict()
    position = read_state(storage, str(dst), "dataloader_0")
    assert position["batches_yielded"] == 3  # saved after 3 of this process's batches
