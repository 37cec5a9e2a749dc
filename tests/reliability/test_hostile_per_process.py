"""Per-process folders that alias or nest, and save folders that are links (issue 23, item 7).

When the processes of one save pass different folders, each folder becomes a complete
checkpoint of its own and each process removes from its folder what its save did not write.
Two names for one folder (a link, a linked parent) or a folder inside another would make each
process delete the other's files while both report success; a save folder that is itself a
link saves fine but can never be loaded. Each is refused, naming the folders, before any process
writes anything: a committed checkpoint already in the folder stays committed and unchanged.
The multi-process cases run on 2 real gloo processes (``tests/helpers/distributed.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.commit.per_process import folder_key, resolve_folder
from accelkit.checkpointing.errors import CheckpointError
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.reliability

# Each case: (process 0's folder, process 1's folder), relative to the test's base folder.
CLASHES = {
    "alias_link": ("real", "link_to_real"),  # refused as a link (it is one)
    "alias_parent_link": ("pdir/ckpt", "pdir_link/ckpt"),
    "nested": ("nest", "nest/sub"),
    "nested_reversed": ("nest/sub2", "nest"),
    "nested_through_link": ("nest", "nest_link/sub3"),
    "linked_folder": ("own0", "linked"),
}
IMPORT_MARKER = {"format": "accelkit-save", "pid": 1, "imported_from": "accelerate-run"}


def _accelerator(project: str | None = None) -> tuple[Accelerator, nn.Module]:
    config = (
        ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        if project
        else None
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = accelerator.prepare(model, optimizer)
    return accelerator, model


def _fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _outcome(call: Any) -> str:
    try:
        return f"ok {call()}"
    except CheckpointError as exc:
        return f"error {exc}"


def _clashes(base: str) -> dict[str, Any]:
    """On each of 2 processes: every clash, a good per-process save, then automatic saves
    whose name is taken (a link; an import's folder made between two saves)."""
    accelerator, model = _accelerator(os.path.join(base, "proj"))
    rank = accelerator.process_index
    _fill(model, 10.0 + rank)
    out: dict[str, Any] = {"rank": rank}
    # checkpoint_0 is a link to a folder outside: refused once on both processes, then on.
    out["auto_link"] = _outcome(accelerator.save_state)
    out["auto_next"] = _outcome(accelerator.save_state)
    if rank == 0:  # an import commits checkpoint_2 between two saves of the job
        taken = Path(base, "proj", "checkpoints", "checkpoint_2")
        taken.mkdir()
        (taken / ".accelkit-save.json").write_text(json.dumps(IMPORT_MARKER))
    accelerator.wait_for_everyone()
    out["auto_past_import"] = _outcome(accelerator.save_state)
    out["auto_after"] = _outcome(accelerator.save_state)
    out["iteration"] = accelerator.project_configuration.iteration
    for case, folders in CLASHES.items():
        out[case] = _outcome(lambda f=folders: accelerator.save_state(os.path.join(base, f[rank])))
    side = os.path.join(base, "side", f"r{rank}")
    out["side"] = _outcome(lambda: accelerator.save_state(side))
    # One folder spelt two ways is one folder: a checkpoint shared by both processes.
    shared = ("dots/ckpt", "dots/x/../ckpt/.")[rank]
    out["shared"] = _outcome(lambda: accelerator.save_state(os.path.join(base, shared)))
    return out


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` with its content and mtime (to prove nothing touched it)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _committed(folder: Path, value: float) -> None:
    """A committed one-process checkpoint in ``folder`` whose weights are all ``value``."""
    accelerator, model = _accelerator()
    _fill(model, value)
    accelerator.save_state(str(folder))


def _loads(folder: Path, value: float) -> bool:
    accelerator, model = _accelerator()
    accelerator.load_state(str(folder))
    return all(bool((p == value).all()) for p in model.parameters())


def test_aliasing_nested_and_linked_per_process_folders_are_refused_before_any_write(
    tmp_path: Path,
) -> None:
    for name, value in (("real", 1.0), ("pdir/ckpt", 2.0), ("nest", 4.0)):
        _committed(tmp_path / name, value)
    (tmp_path / "link_to_real").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "pdir_link").symlink_to(tmp_path / "pdir", target_is_directory=True)
    (tmp_path / "nest_link").symlink_to(tmp_path / "nest", target_is_directory=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (tmp_path / "linked").symlink_to(elsewhere, target_is_directory=True)
    checkpoints = tmp_path / "proj" / "checkpoints"
    checkpoints.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".accelkit-save.json").write_text(json.dumps(IMPORT_MARKER))
    (checkpoints / "checkpoint_0").symlink_to(outside, target_is_directory=True)
    watched = [tmp_path / n for n in ("real", "pdir", "nest", "elsewhere", "outside")]
    before = {p: _tree(p) for p in watched}

    results = run_distributed(_clashes, str(tmp_path), timeout=180)

    for case, folders in CLASHES.items():
        for rank, r in enumerate(results):
            message = r[case]
            assert message.startswith("error "), (case, rank, message)
            if case in ("linked_folder", "alias_link"):  # process 1's folder is a link itself
                assert "symbolic link" in message and folders[1] in message, message
                assert rank == 1 or "failed on process 1 while preparing" in message, message
                continue
            assert "nothing was written" in message, (case, message)
            word = "one folder" if case.startswith("alias") else "inside"
            assert word in message, (case, message)
            for folder in folders:  # both folders named, as given (made absolute)
                assert str(Path(os.path.normpath(tmp_path / folder))) in message, (case, message)
    # Nothing written anywhere: the committed checkpoints there are unchanged and still load.
    assert {p: _tree(p) for p in watched} == before
    for sub in ("nest/sub", "nest/sub2", "nest/sub3", "own0", "side/r0/sub"):
        assert not (tmp_path / sub).exists(), sub
    for name, value in (("real", 1.0), ("pdir/ckpt", 2.0), ("nest", 4.0)):
        assert _loads(tmp_path / name, value), name

    # Folders side by side: a checkpoint per process, each with its own weights.
    for rank, r in enumerate(results):
        folder = tmp_path / "side" / f"r{rank}"
        assert r["side"] == f"ok {folder}", r["side"]
        manifest = json.loads((folder / "accelkit.json").read_text())
        assert manifest["process_index"] == rank
        weights = load_file(str(folder / "model.safetensors"))  # a load is the writer's only
        assert all(bool((t == 10.0 + rank).all()) for t in weights.values()), rank
    shared = tmp_path / "dots" / "ckpt"
    assert [r["shared"] for r in results] == [
        f"ok {tmp_path / 'dots' / 'ckpt'}",
        f"ok {tmp_path}/dots/x/../ckpt/.",
    ]
    manifest = json.loads((shared / "accelkit.json").read_text())
    assert "process_index" not in manifest and manifest["world_size"] == 2
    assert _loads(shared, 10.0)

    # Automatic naming on 2 processes: a link in the way is refused once on both (nothing
    # written through it) and both counters move past it; a folder an import took is skipped
    # under the lock, every process adopting the main process's number.
    for r in results:
        assert r["auto_link"].startswith("error ") and "checkpoint_0" in r["auto_link"]
        assert "already exists" in r["auto_link"], r["auto_link"]
        assert r["auto_next"] == f"ok {checkpoints / 'checkpoint_1'}"
        assert r["auto_past_import"] == f"ok {checkpoints / 'checkpoint_3'}"
        assert r["auto_after"] == f"ok {checkpoints / 'checkpoint_4'}"
        assert r["iteration"] == 5
    assert sorted(p.name for p in (checkpoints / "checkpoint_2").iterdir()) == [
        ".accelkit-save.json"
    ]
    assert _tree(outside) == before[outside]


def test_a_save_folder_that_is_a_link_is_refused_one_under_a_linked_parent_is_not(
    tmp_path: Path,
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    committed = tmp_path / "committed"
    _committed(committed, 6.0)
    committed_link = tmp_path / "committed_link"
    committed_link.symlink_to(committed, target_is_directory=True)
    before = {p: _tree(p) for p in (target, committed)}
    accelerator, model = _accelerator()
    _fill(model, 8.0)
    for given in (str(link), f"{link}/", str(committed_link), f"{committed_link}//"):
        with pytest.raises(CheckpointError, match="symbolic link") as info:
            accelerator.save_state(given)
        assert "nothing was written" in str(info.value) and given in str(info.value)
    assert {p: _tree(p) for p in before} == before  # neither un-committed nor written into
    assert _loads(committed, 6.0)
    # A link above the checkpoint folder is not inside it: loading accepts it, so saving does.
    parent_link = tmp_path / "parent_link"
    parent_link.symlink_to(target, target_is_directory=True)
    path = accelerator.save_state(str(parent_link / "ckpt"))
    assert _loads(Path(path), 8.0)
    assert (target / "ckpt" / "accelkit.json").exists()


def test_folders_are_compared_resolved(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    assert folder_key(str(tmp_path / "alias" / "ckpt")) == str(real / "ckpt")
    assert folder_key(f"file://{tmp_path}/real/./x/") == str(real / "x")
    assert folder_key("s3://Bucket//run/./a/../b/") == "s3://Bucket/run/b"
    assert folder_key("S3://b/run") == "s3://b/run"
    one, other = resolve_folder(str(real)), resolve_folder(str(tmp_path / "alias"))
    assert one.identity is not None and one.identity == other.identity
    assert one.name != other.name and one.real == other.real
    # A folder that does not exist yet is identified by its nearest existing parent.
    assert resolve_folder(str(real / "new" / "ckpt")).identity == (*one.identity[:3], "new/ckpt")
