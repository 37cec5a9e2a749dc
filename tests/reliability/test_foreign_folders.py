"""Folders accelkit did not write are never deleted, and files it did not write cannot steer it.

The contract: every accelkit save writes ``.accelkit-save.json`` into its checkpoint folder when
the save starts (kept, and listed in the manifest, once committed). ``accelkit ckpt ls`` tells
``committed``, ``incomplete`` (an accelkit save that did not finish: the marker without a
manifest, or an empty ``checkpoint_<n>``), ``corrupt``, ``accelerate`` (a Hugging Face
accelerate checkpoint: no manifest, no marker, accelerate's files) and ``foreign`` (anything
else). ``ckpt prune`` deletes old committed and old incomplete ones only; loading reads an
accelerate checkpoint safely (issue 18: it refuses one that does not fit the objects, naming
it as accelerate's) and ``load_state()`` takes it only when it is the newest by number.

Beyond the listed contract (holes found while attacking; see README):

- a manifest whose ``iteration`` disagrees with its ``checkpoint_<n>`` name must not become
  "the newest" checkpoint, steer the next folder name, or make retention delete real ones;
- a hostile save lock ``.accelkit-run.lock`` (absurd timestamps or pids, a link) ends a save in
  a ``CheckpointError`` naming the lock, never another exception, and deletes nothing else.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CheckpointError
from tests.reliability.test_hostile import _ckpt, _Counter, _model, _run_cli

MARKER = ".accelkit-save.json"


def _accelkit(project: Path, **config: object) -> tuple[Accelerator, torch.nn.Module, _Counter]:
    cfg = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, **config)
    accelerator = Accelerator(project_config=cfg, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, counter


_HF_SAVE = """
import sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

config = ProjectConfiguration(sys.argv[1], automatic_checkpoint_naming=True)
accelerator = Accelerator(project_config=config, cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.save_state()
"""


def _hf_accelerate_checkpoint(project: Path) -> Path:
    """A real checkpoint written by Hugging Face accelerate's ``save_state`` (checkpoint_0), in a
    subprocess so that accelerate's process-wide state stays out of this one."""
    subprocess.run([sys.executable, "-c", _HF_SAVE, str(project)], check=True, timeout=180)
    folder = _ckpt(project, 0)
    assert (folder / "model.safetensors").exists() and (folder / "optimizer.bin").exists()
    return folder


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _states(capsys: pytest.CaptureFixture[str], project: Path) -> dict[str, str]:
    code, out = _run_cli(capsys, "ckpt", "ls", str(project), "--json")
    assert code == 0, out
    return {row["name"]: row["state"] for row in json.loads(out[: out.rindex("]") + 1])}


def test_the_save_marker_is_written_first_and_listed(tmp_path: Path) -> None:
    accelerator, _, _ = _accelkit(tmp_path / "p")
    seen: list[bool] = []
    accelerator.register_save_state_pre_hook(
        lambda models, weights, folder: seen.append(os.path.exists(os.path.join(folder, MARKER)))
    )
    folder = Path(accelerator.save_state())
    assert seen == [True], "the marker was not there when the files were being written"
    manifest = json.loads((folder / "accelkit.json").read_text())
    assert MARKER in {e["path"] for e in manifest["files"]}, manifest["files"]


def test_prune_never_deletes_what_accelkit_did_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "project"
    hf = _hf_accelerate_checkpoint(project)  # checkpoint_0
    hf_before = _tree(hf)
    user = _ckpt(project, 1)  # checkpoint_1: the user's own folder
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    accelerator, _, counter = _accelkit(project, iteration=2)
    counter.n = 2
    accelerator.save_state()  # checkpoint_2
    counter.n = 3
    accelerator.save_state()  # checkpoint_3, then "interrupted": its manifest never written
    (_ckpt(project, 3) / "accelkit.json").unlink()
    _ckpt(project, 4).mkdir()  # checkpoint_4: an empty folder (a save that died at once)
    accelerator, _, counter = _accelkit(project, iteration=5)
    for n in (5, 6):
        counter.n = n
        accelerator.save_state()

    problems: list[str] = []
    states = _states(capsys, project)
    want = {
        "checkpoint_0": "accelerate",
        "checkpoint_1": "foreign",
        "checkpoint_2": "committed",
        "checkpoint_3": "incomplete",
        "checkpoint_4": "incomplete",
        "checkpoint_5": "committed",
        "checkpoint_6": "committed",
    }
    if states != want:
        problems.append(f"ckpt ls states: {states}, expected {want}")

    # Loading: the accelerate checkpoint (no registered object) does not fit these objects
    # (one registered counter): refused, named as accelerate's; load_state() takes the newest.
    accelerator, _, counter = _accelkit(project)
    try:
        accelerator.load_state(str(hf))
        problems.append("load_state(<accelerate checkpoint>) loaded it into other objects")
    except CheckpointError as exc:
        text = str(exc)
        if "registered object" not in text or "Hugging Face accelerate" not in text:
            problems.append(f"load_state(<accelerate checkpoint>): {text}")
        if "a save that did not finish" in text:
            problems.append(f"load_state(<accelerate checkpoint>) calls it unfinished: {text}")
    accelerator, _, counter = _accelkit(project)
    loaded = accelerator.load_state()
    if not loaded.endswith("checkpoint_6") or counter.n != 6:
        problems.append(f"load_state() loaded {loaded} (counter {counter.n})")
    code, out = _run_cli(capsys, "ckpt", "verify", str(hf))
    # verify checks an accelerate folder as load_state reads it: healthy, and named as such.
    if code != 0 or "accelerate" not in out or "record no checksums" not in out:
        problems.append(f"ckpt verify <accelerate checkpoint>: exit {code}: {out}")

    # prune: old committed and old incomplete go; accelerate and foreign stay, with a reason.
    code, out = _run_cli(capsys, "ckpt", "prune", str(project), "--keep", "1", "--yes")
    left = sorted(p.name for p in (project / "checkpoints").iterdir())
    if left != ["checkpoint_0", "checkpoint_1", "checkpoint_6"]:
        problems.append(f"after prune: {left}; prune said: {out}")
    if code != 0:
        problems.append(f"prune exit {code}: {out}")
    for name, kind in (("checkpoint_0", "accelerate"), ("checkpoint_1", "foreign")):
        if not any(name in line and kind in line for line in out.splitlines()):
            problems.append(f"prune did not say why it keeps {name} ({kind}): {out}")
    if hf.exists() and _tree(hf) != hf_before:
        problems.append("the accelerate checkpoint's files changed")
    if not (user / "notes.txt").exists():
        problems.append("the user's notes.txt was deleted")
    assert not problems, "\n".join(problems)


def test_a_manifest_cannot_claim_another_iteration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """checkpoint_0's manifest (edited: it is not self-signed) claims iteration 1,000,000. It
    must not become the newest checkpoint, set the next folder name, or make retention delete
    the real newest one: a checkpoint_<n> folder's number is its iteration. (Not "corrupt":
    `save_state(f"checkpoint_{epoch}")` without automatic naming records another iteration
    in the manifest legitimately.)"""
    project = tmp_path / "project"
    accelerator, _, counter = _accelkit(project, total_limit=2)
    for n in (0, 1):
        counter.n = n
        accelerator.save_state()
    manifest_path = _ckpt(project, 0) / "accelkit.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["iteration"] = 1_000_000
    manifest_path.write_text(json.dumps(manifest))

    problems: list[str] = []
    _, out = _run_cli(capsys, "ckpt", "ls", str(project), "--json")
    rows = {row["name"]: row for row in json.loads(out[: out.rindex("]") + 1])}
    if rows["checkpoint_0"]["iteration"] != 0:
        problems.append(f"ls: checkpoint_0 has iteration {rows['checkpoint_0']['iteration']}")
    accelerator, _, counter = _accelkit(project, total_limit=2)
    loaded = accelerator.load_state()
    if not loaded.endswith("checkpoint_1"):
        problems.append(f"load_state() loaded {loaded}")
    counter.n = 2
    saved = accelerator.save_state()
    if not saved.endswith("checkpoint_2"):
        problems.append(f"the next save went to {saved}")
    if not _ckpt(project, 1).exists():
        problems.append("retention deleted the real checkpoint_1 and kept the lying one")
    assert not problems, "\n".join(problems)


_HERE = socket.gethostname()
# Raw lock file contents (None: the lock is a link to a file outside the project).
_LOCKS: dict[str, str | None] = {
    "other-host-far-future": json.dumps({"host": "elsewhere", "pid": 1, "updated": 1e308}),
    "other-host-nan-time": '{"host": "elsewhere", "pid": 1, "updated": NaN}',
    "same-host-huge-pid": json.dumps({"host": _HERE, "pid": 2**80, "updated": 0}),
    "same-host-negative-pid": json.dumps({"host": _HERE, "pid": -1, "started": "1"}),
    "link-to-a-victim": None,
}


@pytest.mark.parametrize("case", sorted(_LOCKS))
def test_a_hostile_run_lock_ends_in_a_clear_error_or_is_taken_over(
    case: str, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    lock = project / ".accelkit-run.lock"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    content = _LOCKS[case]
    if content is None:
        lock.symlink_to(victim)
    else:
        lock.write_text(content)
    accelerator, _, _ = _accelkit(project)
    try:
        saved = accelerator.save_state()
    except CheckpointError as exc:
        assert ".accelkit-run.lock" in str(exc), f"{case}: the error does not name the lock: {exc}"
    except Exception as exc:
        raise AssertionError(f"{case}: {type(exc).__name__} escaped: {exc}") from exc
    else:
        assert Path(saved, "accelkit.json").exists()  # taken over as stale: a normal save
    assert victim.read_text() == "precious"  # neither written, nor deleted
