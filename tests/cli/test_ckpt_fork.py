"""``accelkit ckpt fork`` and ``accelkit ckpt ls --tree``: forks as a user makes and lists
them, and as a crafted manifest would twist them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from accelkit.cli.main import main
from tests.trackers.test_fork import _job


def _manifest_path(project: Path, n: int) -> Path:
    return project / "checkpoints" / f"checkpoint_{n}" / "accelkit.json"


def _lineage(project: Path, n: int) -> dict[str, Any]:
    return dict(json.loads(_manifest_path(project, n).read_text())["experiment"]["lineage"])


def _three_projects(tmp_path: Path) -> tuple[Path, Path, Path]:
    """a: checkpoint_0 and _1; b: forked from a's checkpoint_0 (its save, numbered past the
    loaded one, is checkpoint_1); c: a copy of b's save made by ``ckpt fork``."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _job(a, None)
    _job(a, None, load="newest")
    _job(b, None, load=str(a / "checkpoints" / "checkpoint_0"), fork=True)
    assert main(["ckpt", "fork", str(b / "checkpoints" / "checkpoint_1"), str(c)]) == 0
    return a, b, c


def test_ls_tree_shows_each_fork_under_the_checkpoint_it_forked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = _three_projects(tmp_path)
    capsys.readouterr()
    assert main(["ckpt", "ls", str(a), "--tree", "--with", str(b), "--with", str(c)]) == 0
    lines = capsys.readouterr().out.splitlines()
    b_line, c_line = _lineage(b, 1)["id"], _lineage(c, 1)["id"]
    names = [
        line.strip().split()[0] if not line.strip().startswith("└─") else line.strip()[:14]
        for line in lines
    ]
    assert (
        names
        == [
            "checkpoint_0",
            f"└─ fork {b_line[:8]}"[:14],
            "checkpoint_1",  # b's
            f"└─ fork {c_line[:8]}"[:14],
            "checkpoint_1",  # c's copy
            "checkpoint_1",  # a's own, after the fork it holds
        ]
    )
    assert f"of {a / 'checkpoints' / 'checkpoint_0'} (after step -1; parent runs -)" in lines[1]
    # Each fork is indented under its parent; c's deeper than b's.
    indent = [len(line) - len(line.lstrip()) for line in lines]
    assert indent == [0, 3, 6, 9, 12, 0]
    assert lines[2].endswith(f"in {b / 'checkpoints'}") and lines[4].endswith(
        f"in {c / 'checkpoints'}"
    )

    assert main(["ckpt", "ls", str(a), "--tree", "--with", str(b), "--json"]) == 0
    [root] = json.loads(capsys.readouterr().out)
    assert root["line"] is None and [x["name"] for x in root["checkpoints"]] == [
        "checkpoint_0",
        "checkpoint_1",
    ]
    [fork] = root["checkpoints"][0]["forks"]
    assert fork["line"] == b_line
    assert fork["parent"]["checkpoint"] == str(a / "checkpoints" / "checkpoint_0")
    assert [x["path"] for x in fork["checkpoints"]] == [str(b / "checkpoints" / "checkpoint_1")]
    assert root["checkpoints"][1]["forks"] == []


def test_ls_tree_of_a_fork_alone_names_its_parent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, _ = _three_projects(tmp_path)
    capsys.readouterr()
    assert main(["ckpt", "ls", str(b), "--tree"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("└─ fork ") and str(a / "checkpoints" / "checkpoint_0") in first
    assert second.strip().startswith("checkpoint_1")


def test_with_needs_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _job(tmp_path / "a", None)
    assert main(["ckpt", "ls", str(tmp_path / "a"), "--with", str(tmp_path / "a")]) == 2
    assert "add --tree" in capsys.readouterr().err


def test_a_crafted_circle_of_parents_lists_every_checkpoint_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = tmp_path / "x", tmp_path / "y"
    _job(x, None)
    _job(y, None)
    for here, there, line in ((x, y, "a" * 32), (y, x, "b" * 32)):
        manifest = json.loads(_manifest_path(here, 0).read_text())
        parent = {"checkpoint": str(there / "checkpoints" / "checkpoint_0"), "step": 1}
        manifest["experiment"] = {"lineage": {"id": line, "parent": parent}}
        _manifest_path(here, 0).write_text(json.dumps(manifest))
    assert main(["ckpt", "ls", str(x), "--tree", "--with", str(y)]) == 0
    out = capsys.readouterr().out
    assert out.count("checkpoint_0  committed") == 2  # each once: the circle is cut


def test_a_crafted_parent_path_cannot_write_to_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _job(tmp_path / "a", None)
    manifest = json.loads(_manifest_path(tmp_path / "a", 0).read_text())
    parent = {"checkpoint": "/x\x1b]0;owned\x07\n└─ fork fake", "step": 1}
    manifest["experiment"] = {"lineage": {"id": "c" * 32, "parent": parent}}
    _manifest_path(tmp_path / "a", 0).write_text(json.dumps(manifest))
    assert main(["ckpt", "ls", str(tmp_path / "a"), "--tree"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert len(out.splitlines()) == 2  # the newline in the path starts no line of its own


def test_fork_refuses_what_it_cannot_fork_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = tmp_path / "a"
    _job(a, None)
    _job(a, None, load="newest")
    # A folder of checkpoints is not one checkpoint.
    assert main(["ckpt", "fork", str(a), str(tmp_path / "b")]) == 2
    assert "not one committed checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    # A project that already holds a newer checkpoint would not resume from the fork.
    assert main(["ckpt", "fork", str(a / "checkpoints" / "checkpoint_0"), str(a)]) == 2
    assert "would not be the checkpoint its project resumes from" in capsys.readouterr().err
    # A damaged source file fails the copy: the target is never committed.
    source = a / "checkpoints" / "checkpoint_1"
    data = max(
        (p for p in source.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["ckpt", "fork", str(source), str(tmp_path / "c")]) != 0
    assert not (tmp_path / "c" / "checkpoints" / "checkpoint_1" / "accelkit.json").exists()


def test_fork_names_the_copy_so_that_its_project_resumes_from_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from accelkit import Accelerator

    accelerator = Accelerator()
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(str(tmp_path / "final"))
    # A folder named by the user becomes checkpoint_<its iteration> in the new project.
    assert main(["ckpt", "fork", str(tmp_path / "final"), str(tmp_path / "b")]) == 0
    assert _lineage(tmp_path / "b", 0)["start"] is True
    # One with no iteration (a manifest that records none) has no such name: refused.
    manifest = json.loads((tmp_path / "final" / "accelkit.json").read_text())
    manifest["iteration"] = None
    (tmp_path / "final" / "accelkit.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["ckpt", "fork", str(tmp_path / "final"), str(tmp_path / "c")]) == 2
    assert "load_state(path, fork=True)" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_fork_of_an_incomplete_checkpoint_names_its_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = tmp_path / "a"
    _job(a, None)
    _manifest_path(a, 0).unlink()  # a save that never committed
    assert main(["ckpt", "fork", str(a / "checkpoints" / "checkpoint_0"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "is incomplete, not one committed checkpoint" in err and "ckpt ls" in err
    assert not (tmp_path / "b").exists()
