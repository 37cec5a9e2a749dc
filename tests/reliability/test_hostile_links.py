"""Symbolic links and special files inside checkpoints: never followed, never read, never deleted.

The contract: no path component inside a checkpoint (its folder, a subfolder, a file) may be a
symbolic link, on every read path; a decoy outside keeps its content and mtime. The sharded
(``sharded/`` -> outside) case runs on 2 FSDP processes in ``test_hostile_dcp.py``; here are the
checkpoint folder that is itself a link, an index path through a linked subfolder, and a named
pipe where a file should be (which blocks a reader forever rather than leaking data, so the
checks run in a subprocess with a time limit).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from accelkit.checkpointing import load_checkpoint_in_model, save_model
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from tests.reliability.test_hostile import _accelerator, _ckpt, _model, _resign, _run_cli

REPO = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: content and mtime (to prove nothing touched it)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with two committed checkpoints (``checkpoint_0``, ``checkpoint_1``)."""
    root = tmp_path / "project"
    accelerator, _ = _accelerator(root)
    accelerator.save_state()
    accelerator.save_state()
    return root


def _decoy(tmp_path: Path) -> Path:
    """A valid committed checkpoint of another run whose weights are all 666."""
    other = tmp_path / "elsewhere"
    accelerator, model = _accelerator(other)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(666.0)
    accelerator.save_state()
    return _ckpt(other, 0)


def test_a_checkpoint_folder_that_is_a_link_is_refused(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    decoy = _decoy(tmp_path)
    before = _tree(decoy)
    link = project / "checkpoints" / "checkpoint_5"
    link.symlink_to(decoy)
    problems: list[str] = []

    # load_state(path) of the link (with and without a trailing slash) refuses it.
    for given in (str(link), str(link) + "/"):
        accelerator, model = _accelerator(project)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            loaded = accelerator.load_state(given)
            problems.append(f"load_state({given!r}) loaded {loaded} through the link")
        except CheckpointError as exc:
            if "symbolic link" not in str(exc):
                problems.append(f"load_state({given!r}): no 'symbolic link' in {exc}")
        if any(not torch.equal(weights[k], v) for k, v in model.state_dict().items()):
            problems.append(f"load_state({given!r}) changed the weights (to the decoy's)")

    # load_state() never picks it, though its number is the highest.
    accelerator, model = _accelerator(project)
    loaded = accelerator.load_state()
    if not loaded.endswith("checkpoint_1"):
        problems.append(f"load_state() picked {loaded}")
    if any((p == 666.0).any() for p in model.parameters()):
        problems.append("load_state() loaded the decoy's weights")

    for action in ("inspect", "verify"):
        code, out = _run_cli(capsys, "ckpt", action, str(link))
        if code != 1 or "symbolic link" not in out:
            problems.append(f"ckpt {action} of the link: exit {code}: {out[-400:]}")
    code, out = _run_cli(capsys, "ckpt", "prune", str(project), "--keep", "1", "--yes")
    if code != 0:
        problems.append(f"ckpt prune: exit {code}: {out}")
    if _tree(decoy) != before:
        problems.append("the decoy's files changed")
    assert not problems, "\n".join(problems)


def test_an_index_path_through_a_linked_subfolder_is_refused(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A valid shard outside, reached through "sub" -> outside: only the link check stops it.
    outside = tmp_path / "outside"
    evil = _model()
    with torch.no_grad():
        for p in evil.parameters():
            p.fill_(666.0)
    save_model(evil, str(outside))
    shard = "model-00001-of-00001.safetensors"
    os.rename(outside / "model.safetensors", outside / shard)
    before = _tree(outside)
    index = {"metadata": {}, "weight_map": {k: f"sub/{shard}" for k in evil.state_dict()}}

    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "sub").symlink_to(outside)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = _model()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for path in (folder, folder / "model.safetensors.index.json"):
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            load_checkpoint_in_model(model, str(path))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())

    # The same inside a committed checkpoint, manifest re-signed through the link.
    hostile = project / "checkpoints" / "checkpoint_4"
    shutil.copytree(_ckpt(project), hostile)
    (hostile / "model.safetensors").unlink()
    (hostile / "sub").symlink_to(outside)
    (hostile / "model.safetensors.index.json").write_text(json.dumps(index))
    _resign(
        hostile,
        {
            "model.safetensors.index.json": hostile / "model.safetensors.index.json",
            f"sub/{shard}": outside / shard,
        },
    )
    problems: list[str] = []
    accelerator, model = _accelerator(project)
    try:
        accelerator.load_state(str(hostile))
        problems.append("load_state read a shard through the linked subfolder")
    except CorruptCheckpointError as exc:
        if "symbolic link" not in str(exc):
            problems.append(f"load_state: no 'symbolic link' in {exc}")
    if any((p == 666.0).any() for p in model.parameters()):
        problems.append("load_state loaded the weights outside")
    code, out = _run_cli(capsys, "ckpt", "inspect", str(hostile))
    if code != 1 or "symbolic link" not in out:
        problems.append(f"ckpt inspect: exit {code}, read through the link: {out[-600:]}")
    code, out = _run_cli(capsys, "ckpt", "verify", str(hostile))
    if code != 1:
        problems.append(f"ckpt verify: exit {code}: {out[-600:]}")
    if _tree(outside) != before:
        problems.append("the files outside changed")
    assert not problems, "\n".join(problems)


_FIFO_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.checkpointing.errors import CorruptCheckpointError
    from accelkit.cli.main import main

    project, folder = sys.argv[1], sys.argv[2]
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))

    class Counter:
        n = 0
        def state_dict(self): return {"n": self.n}
        def load_state_dict(self, s): self.n = s["n"]

    accelerator.register_for_checkpointing(Counter())
    try:
        accelerator.load_state(folder)
        print("LOAD: loaded", flush=True)
    except CorruptCheckpointError as exc:
        print("LOAD: refused:", exc, flush=True)
    print("VERIFY:", main(["ckpt", "verify", folder]), flush=True)
    print("LS:", main(["ckpt", "ls", project, "--json"]), flush=True)
    """
)


def test_a_named_pipe_in_a_checkpoint_does_not_hang_readers(project: Path) -> None:
    """A FIFO where a listed file should be (a tarball can carry one): opening it for reading
    blocks until somebody writes. Loading and verifying must refuse it as not a regular file,
    promptly, instead of hanging forever."""
    folder = _ckpt(project)
    os.mkfifo(folder / "notes.txt")
    _resign(folder, {"notes.txt": _empty(project)})  # listed: size 0, checksum of b""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        run = subprocess.run(
            [sys.executable, "-c", _FIFO_SCRIPT, str(project), str(folder)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"a reader blocked on the named pipe for 30 s; output so far: {out!r}")
    out = run.stdout + run.stderr
    assert "LOAD: refused" in out and "notes.txt" in out, out
    assert "VERIFY: 1" in out, out


def _empty(project: Path) -> Path:
    path = project.parent / "empty-file"
    path.write_bytes(b"")
    return path
