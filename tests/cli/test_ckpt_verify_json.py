"""``accelkit ckpt verify --json``, the file counts ``ls`` and ``verify`` agree on, and
``ckpt inspect PROJECT`` (issue #28's smaller items), on checkpoints a real ``save_state``
wrote: one intact (with a stray file beside its files), one with a flipped byte, one whose
save did not finish.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.cli.main import main


@pytest.fixture
def project(tmp_path: Path) -> Path:
    config = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        accelerator.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        accelerator.save_state()
    folders = tmp_path / "checkpoints"
    (folders / "checkpoint_0" / "notes.txt").write_text("mine\n")
    damaged = folders / "checkpoint_1" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (folders / "checkpoint_2" / "accelkit.json").unlink()  # as a crash before the commit
    return tmp_path


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_json_gives_each_verdict_with_the_exit_code(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _cli(capsys, "ckpt", "verify", str(project), "--json")
    assert code == 1, err
    doc = json.loads(out)  # stdout is the JSON alone
    assert (doc["checked"], doc["intact"], doc["failed"]) == (2, 1, 1)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert rows["checkpoint_0"]["result"] == "ok"
    assert rows["checkpoint_0"]["not_in_manifest"] == ["notes.txt"]
    assert rows["checkpoint_1"]["result"] == "fail"
    assert any(
        p.startswith("model.safetensors: checksum") for p in rows["checkpoint_1"]["problems"]
    )
    assert (
        rows["checkpoint_2"]["result"] == "skip" and "incomplete" in rows["checkpoint_2"]["reason"]
    )
    assert "1 checkpoint(s)" in err and "failed" in err

    code, out, err = _cli(
        capsys, "ckpt", "verify", str(project / "checkpoints" / "checkpoint_0"), "--json"
    )
    assert code == 0, err
    assert json.loads(out)["intact"] == 1


def test_ls_and_verify_count_the_same_files(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "checkpoints" / "checkpoint_0" / "notes.txt").unlink()
    _, out, _ = _cli(capsys, "ckpt", "ls", str(project), "--json")
    listed = {r["name"]: r["files"] for r in json.loads(out)}
    _, out, _ = _cli(capsys, "ckpt", "verify", str(project), "--json")
    verified = {r["name"]: r["files"] for r in json.loads(out)["checkpoints"] if "files" in r}
    assert verified == {k: listed[k] for k in verified}
    _, out, _ = _cli(capsys, "ckpt", "verify", str(project))
    assert f"OK    checkpoint_0: {listed['checkpoint_0']} files" in out


def test_inspect_of_a_project_shows_its_newest_committed_checkpoint(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _cli(capsys, "ckpt", "inspect", str(project), "--json")
    assert code == 0, err
    newest = project / "checkpoints" / "checkpoint_1"  # checkpoint_2 did not commit
    assert f"inspecting {newest}, the newest committed checkpoint" in err
    doc = json.loads(out)
    # One checkpoint's files (paths inside it), the model's tensors first.
    assert doc["files"] and all("/" not in f["file"] for f in doc["files"])
    assert doc["tensors"][0]["file"] == "model.safetensors"
    assert not any("checkpoint_2" in f["file"] for f in doc["files"])
