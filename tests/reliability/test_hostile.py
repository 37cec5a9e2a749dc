"""Hostile checkpoints: refused with a clear error; nothing runs, nothing outside is touched.

Each case starts from a real committed checkpoint written by ``save_state`` and plants one
hostile part. Where a checksum would already stop it, the manifest is *re-signed* (sizes and
checksums recomputed) so that the check under test is the only defence left. Every case then
goes through ``load_state``, ``load_checkpoint_in_model`` and the CLI (``verify``, ``inspect``,
``prune``, in-process through ``accelkit.cli.main.main``).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import pickle
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing import load_checkpoint_in_model, save_model
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.formats.manifest import FileEntry, file_checksum, read_manifest
from accelkit.checkpointing.storage import get_storage
from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM
from accelkit.cli.main import main as cli


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _accelerator(project: Path) -> tuple[Accelerator, nn.Module]:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(_Counter())
    return accelerator, model


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with two committed checkpoints (``checkpoint_0``, ``checkpoint_1``)."""
    root = tmp_path / "project"
    accelerator, _ = _accelerator(root)
    accelerator.save_state()
    accelerator.save_state()
    return root


def _ckpt(project: Path, n: int = 1) -> Path:
    return project / "checkpoints" / f"checkpoint_{n}"


def _resign(folder: Path, add: dict[str, Path] | None = None) -> None:
    """Recompute the manifest's sizes/checksums from the files as they are now (following
    ``add`` extra name -> file), so that only the defence under test can refuse them."""
    storage = get_storage(str(folder))
    manifest = read_manifest(storage, str(folder))
    assert manifest is not None
    entries = {e.path: e for e in manifest.files}
    for name in list(entries) + list(add or {}):
        source = (add or {}).get(name, folder / name)
        path = source.resolve() if source.is_symlink() else source
        if not path.exists():
            entries.pop(name, None)
            continue
        size, checksum = file_checksum(get_storage(str(path)), str(path), DEFAULT_ALGORITHM)
        entries[name] = FileEntry(name, size, checksum)
    data = json.loads(manifest.to_json())
    data["files"] = [
        {"path": e.path, "size": e.size, "checksum": e.checksum}
        for e in sorted(entries.values(), key=lambda e: e.path)
    ]
    (folder / "accelkit.json").write_text(json.dumps(data))


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def _load_state_fails(project: Path, folder: Path | None = None) -> CheckpointError:
    accelerator, model = _accelerator(project)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(None if folder is None else str(folder))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed weights"
    return info.value


# ------------------------------------------------------------------ code-executing pickles


class _Payload:
    """Unpickling this runs ``exec``: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _pickles(marker: Path) -> dict[str, bytes]:
    buffer = __import__("io").BytesIO()
    torch.save({"weight": _Payload(marker)}, buffer)
    return {"raw": pickle.dumps(_Payload(marker), protocol=2), "torch": buffer.getvalue()}


@pytest.mark.parametrize("kind", ["raw", "torch"])
def test_a_code_executing_pickle_runs_nothing(
    kind: str, project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "PWNED"
    payload = _pickles(marker)[kind]
    folder = _ckpt(project)

    # 1. A pickle where the model's safetensors file is expected, manifest re-signed.
    hostile = project / "checkpoints" / "checkpoint_7"
    shutil.copytree(folder, hostile)
    (hostile / "model.safetensors").write_bytes(payload)
    _resign(hostile)
    error = _load_state_fails(project, hostile)
    assert isinstance(error, CorruptCheckpointError) and "model.safetensors" in str(error)

    # 2. Pickles where accelkit's last-resort torch file (.pt, weights_only) is read.
    for stem in ("custom_checkpoint_0", "random_states_0", "optimizer"):
        bad = project / "checkpoints" / f"checkpoint_{stem}"
        shutil.copytree(folder, bad)
        (bad / f"{stem}.pt").write_bytes(payload)
        _resign(bad, {f"{stem}.pt": bad / f"{stem}.pt"})
        error = _load_state_fails(project, bad)
        assert f"{stem}.pt" in str(error) and "weights_only" in str(error), error
        # Present but not listed in the manifest, checksums off: not part of the
        # checkpoint, so never read (the load succeeds from the listed files).
        unlisted = project / "checkpoints" / f"unlisted_{stem}"
        shutil.copytree(folder, unlisted)
        (unlisted / f"{stem}.pt").write_bytes(payload)
        accelerator, _ = _accelerator(project)
        accelerator.load_state(str(unlisted), verify=False)

    # 3. The reference's pytorch_model.bin, read by load_checkpoint_in_model.
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "pytorch_model.bin").write_bytes(payload)
    for target in (weights, weights / "pytorch_model.bin"):
        with pytest.raises(CorruptCheckpointError, match=r"pytorch_model\.bin.*weights_only"):
            load_checkpoint_in_model(_model(), str(target))

    # 4. The CLI: inspect refuses the fake safetensors file; verify (against the original
    # manifest) names it; neither unpickles anything.
    code, out = _run_cli(capsys, "ckpt", "inspect", str(hostile))
    assert code == 1 and "model.safetensors" in out, out
    shutil.copy(folder / "accelkit.json", hostile / "accelkit.json")
    code, out = _run_cli(capsys, "ckpt", "verify", str(hostile))
    assert code == 1 and "model.safetensors" in out, out
    code, out = _run_cli(capsys, "ckpt", "inspect", str(weights))
    assert code == 1, out
    assert not marker.exists(), "the pickle's code ran"


# ------------------------------------------------------------------ hostile safetensors headers


def _safetensors(header: dict[str, Any], data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


_HOSTILE_HEADERS = {
    # An 8-byte length prefix claiming an absurd header: never allocated.
    "huge-header-length": _safetensors({}, b"", length=2**62),
    # A tensor claiming 2**62 elements (offsets consistent with the shape, past the file end).
    "huge-tensor": _safetensors(
        {"0.weight": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 2**64]}},
        b"\0" * 16,
    ),
    # 1 TiB claimed by a 16-byte file: must be refused before any allocation.
    "terabyte-tensor": _safetensors(
        {"0.weight": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}},
        b"\0" * 16,
    ),
    # Offsets past the end of the file.
    "past-the-end": _safetensors(
        {"0.weight": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, 128]}}, b"\0" * 16
    ),
    # Two tensors sharing bytes.
    "overlapping": _safetensors(
        {
            "0.bias": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "2.bias": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        },
        b"\0" * 24,
    ),
    # A shape that does not match its byte range.
    "shape-mismatch": _safetensors(
        {"0.bias": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 16]}}, b"\0" * 16
    ),
    # A header length past the end of a small file.
    "length-past-end": _safetensors({}, b"", length=4096),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_HEADERS))
def test_hostile_safetensors_header_is_refused(
    case: str,
    project: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    blob = _HOSTILE_HEADERS[case]
    hostile = project / "checkpoints" / "checkpoint_9"
    shutil.copytree(_ckpt(project), hostile)
    (hostile / "model.safetensors").write_bytes(blob)
    _resign(hostile)

    error = _load_state_fails(project, hostile)
    assert isinstance(error, CorruptCheckpointError), error
    assert "model.safetensors" in str(error), error

    single = tmp_path / "hostile.safetensors"
    single.write_bytes(blob)
    with pytest.raises(CorruptCheckpointError, match=r"hostile\.safetensors"):
        load_checkpoint_in_model(_model(), str(single))

    code, out = _run_cli(capsys, "ckpt", "inspect", str(single))
    assert code == 1 and "hostile.safetensors" in out, out
    code, out = _run_cli(capsys, "ckpt", "inspect", str(hostile))
    assert code == 1 and "model.safetensors" in out, out
    # load_state() without a path skips the hostile newest one (with a warning naming it),
    # resumes from the newest that loads, and deletes nothing.
    accelerator, _ = _accelerator(project)
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        assert accelerator.load_state().endswith("checkpoint_1")
    assert "checkpoint_9" in caplog.text and "damaged" in caplog.text, caplog.text
    assert (hostile / "model.safetensors").read_bytes() == blob


# ------------------------------------------------------------------ indexes leaving the folder


@pytest.mark.parametrize("where", ["dotdot", "absolute", "nested-dotdot", "backslash"])
def test_index_naming_files_outside_is_refused(
    where: str, project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A perfectly valid weights file outside the folder, with recognisable values: loading it
    # would succeed, so only the path check can stop it.
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = _model()
    with torch.no_grad():
        for p in evil.parameters():
            p.fill_(666.0)
    save_model(evil, str(outside))
    target = outside / "model.safetensors"
    name = {
        "dotdot": "../outside/model.safetensors",
        "absolute": str(target),
        "nested-dotdot": "sub/../../outside/model.safetensors",
        "backslash": "..\\outside\\model.safetensors",
    }[where]
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "sub").mkdir()
    index = {"metadata": {}, "weight_map": {k: name for k in evil.state_dict()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for path in (folder, folder / "model.safetensors.index.json"):
        with pytest.raises(CorruptCheckpointError) as info:
            load_checkpoint_in_model(model, str(path))
        assert "model.safetensors.index.json" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    for path in (folder, folder / "model.safetensors.index.json"):
        code, out = _run_cli(capsys, "ckpt", "inspect", str(path))
        assert code == 1 and "index" in out, out
        assert "666" not in out and "outside" not in out.split("error")[0], out

    # The same index inside a committed checkpoint (manifest re-signed, single file removed).
    hostile = project / "checkpoints" / "checkpoint_5"
    shutil.copytree(_ckpt(project), hostile)
    (hostile / "model.safetensors").unlink()
    shutil.copy(folder / "model.safetensors.index.json", hostile)
    _resign(hostile, {"model.safetensors.index.json": hostile / "model.safetensors.index.json"})
    error = _load_state_fails(project, hostile)
    assert isinstance(error, CorruptCheckpointError) and "index" in str(error), error


# ------------------------------------------------------------------ manifests listing outside


@pytest.mark.parametrize("where", ["dotdot", "absolute"])
def test_manifest_listing_files_outside_is_refused(
    where: str, project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    size, checksum = file_checksum(get_storage(str(victim)), str(victim), DEFAULT_ALGORITHM)
    folder = _ckpt(project, 0)  # the older one: prune would delete it
    data = json.loads((folder / "accelkit.json").read_text())
    path = {"dotdot": "../../../victim.txt", "absolute": str(victim)}[where]
    data["files"].append({"path": path, "size": size, "checksum": checksum})
    (folder / "accelkit.json").write_text(json.dumps(data))

    error = _load_state_fails(project, folder)
    assert isinstance(error, CorruptCheckpointError) and path in str(error), error

    code, out = _run_cli(capsys, "ckpt", "verify", str(folder))
    assert code == 1 and path in out, out
    code, out = _run_cli(capsys, "ckpt", "ls", str(project), "--json")
    states = {row["name"]: row["state"] for row in json.loads(out[: out.rindex("]") + 1])}
    assert states == {"checkpoint_0": "corrupt", "checkpoint_1": "committed"}, out
    code, out = _run_cli(capsys, "ckpt", "inspect", str(folder))
    assert code == 1 and path in out, out
    # prune keeps corrupt checkpoints (they are never deleted automatically) ...
    code, out = _run_cli(capsys, "ckpt", "prune", str(project), "--keep", "1", "--yes")
    assert code == 0, out
    assert folder.exists() and victim.read_text() == "precious"
    # ... and so does training's retention.
    config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1
    )
    accelerator = Accelerator(project_config=config, cpu=True)
    model = _model()
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.register_for_checkpointing(_Counter())
    accelerator.load_state(str(_ckpt(project, 1)))
    accelerator.save_state()
    assert folder.exists() and victim.read_text() == "precious"
    assert not _ckpt(project, 1).exists() and _ckpt(project, 2).exists()


# ------------------------------------------------------------------ symbolic links


def test_symlinked_file_inside_a_checkpoint_is_refused(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The link points to a valid weights file outside; the manifest is re-signed with the
    # target's size and checksum, so only the link check can refuse it.
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(_ckpt(project) / "model.safetensors", outside / "model.safetensors")
    hostile = project / "checkpoints" / "checkpoint_3"
    shutil.copytree(_ckpt(project), hostile)
    (hostile / "model.safetensors").unlink()
    (hostile / "model.safetensors").symlink_to(outside / "model.safetensors")
    _resign(hostile)

    error = _load_state_fails(project, hostile)
    assert "model.safetensors" in str(error) and "link" in str(error), error
    with pytest.raises((CheckpointError, PermissionError), match="link"):
        load_checkpoint_in_model(_model(), str(hostile))
    code, out = _run_cli(capsys, "ckpt", "verify", str(hostile))
    assert code == 1 and "symbolic link" in out, out
    code, out = _run_cli(capsys, "ckpt", "inspect", str(hostile))
    assert code == 1 and "link" in out, out


def test_symlinked_folders_are_never_followed(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another run's committed checkpoint outside, linked in as the "newest" checkpoint, and a
    # linked folder inside an old checkpoint that prune deletes.
    other = tmp_path / "other"
    _accelerator(other)[0].save_state()
    outside_ckpt = other / "checkpoints" / "checkpoint_0"
    before = sorted(p.name for p in outside_ckpt.iterdir())
    (project / "checkpoints" / "checkpoint_99").symlink_to(outside_ckpt)
    keep_dir = tmp_path / "keep"
    keep_dir.mkdir()
    (keep_dir / "data.txt").write_text("precious")
    (_ckpt(project, 0) / "linked").symlink_to(keep_dir)

    accelerator, _ = _accelerator(project)
    assert accelerator.load_state().endswith("checkpoint_1")  # not the linked checkpoint_99
    code, out = _run_cli(capsys, "ckpt", "ls", str(project))
    assert "checkpoint_99" not in out, out
    # A link anywhere inside a checkpoint makes it corrupt: verify fails naming the link,
    # and prune keeps it (corrupt checkpoints are never deleted), so the target is untouched.
    code, out = _run_cli(capsys, "ckpt", "verify", str(_ckpt(project, 0)))
    assert code == 1 and "linked" in out and "symbolic link" in out, out
    code, out = _run_cli(capsys, "ckpt", "prune", str(project), "--keep", "1", "--yes")
    assert code == 0 and "Keeping corrupt checkpoint_0" in out, out
    assert os.path.islink(_ckpt(project, 0) / "linked")
    assert (keep_dir / "data.txt").read_text() == "precious"
    assert sorted(p.name for p in outside_ckpt.iterdir()) == before
    assert os.path.islink(project / "checkpoints" / "checkpoint_99")
