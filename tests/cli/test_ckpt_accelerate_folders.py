"""``accelkit ckpt ls / verify / prune`` on folders that Hugging Face accelerate's ``save_state``
wrote under the names its own examples use (``step_<n>``, ``epoch_<n>``), as ``load_state``
and ``ckpt import`` already take them (issue #28 item 5).

One real accelerate checkpoint (1 process, AdamW after ``SAVE_AT`` optimizer steps) is copied
under several names. STEP must be the optimizer steps read from its optimizer state, never
accelerate's own ``accumulate`` counter; each command explains the ``accelerate`` state in one
line, not one per folder; ``load_state`` says that it read an accelerate checkpoint with no
logging set up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelkit.checkpointing.interop.accelerate_pickle import load_pickle
from accelkit.checkpointing.storage import get_storage
from accelkit.checkpointing.storage.confined import confine
from accelkit.cli.main import main
from tests.checkpointing.accelerate_helpers import RUN_SCRIPT, accelerate_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# Every test needs a real accelerate checkpoint (accelerate imported in a subprocess: ~6 s).
pytestmark = pytest.mark.slow
NAMES = ["step_3", "epoch_1", "step_10"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, accelerate_checkpoint_template: Path) -> Path:
    return accelerate_checkpoint(tmp_path_factory.mktemp("acc1"), accelerate_checkpoint_template)


@pytest.fixture
def outputs(tmp_path: Path, saved: Path) -> Path:
    """A Hydra-style output folder: accelerate's step_/epoch_ folders, no checkpoints/ folder,
    beside folders and files that are no checkpoint."""
    for name in NAMES:
        shutil.copytree(saved, tmp_path / name)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("lr: 0.1\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "train.log").write_text("x\n")
    return tmp_path


def _optimizer_step(folder: Path) -> int:
    """What the optimizer state says, read the safe way."""
    storage = confine(get_storage(str(folder)), str(folder))
    state = load_pickle(storage, str(folder / "optimizer.bin"))
    return max(int(entry["step"]) for entry in state["state"].values())


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_accelerate_folders_by_any_name_with_optimizer_steps(
    outputs: Path, saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = _optimizer_step(saved)
    assert steps == 3  # accelerate_run.py's SAVE_AT: AdamW stepped 3 times
    code, out, err = _cli(capsys, "ckpt", "ls", str(outputs), "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["epoch_1", "step_3", "step_10"]  # numbers, not text
    assert {r["state"] for r in rows} == {"accelerate"}
    assert {r["step"] for r in rows} == {steps}

    code, out, err = _cli(capsys, "ckpt", "ls", str(outputs))
    assert code == 0, err
    table = out.splitlines()
    assert table[0].split()[:4] == ["NAME", "STATE", "ITER", "STEP"]
    assert [line.split()[:4] for line in table[1:]] == [
        [name, "accelerate", "-", str(steps)] for name in ("epoch_1", "step_3", "step_10")
    ]
    # One line explains the state, whatever the number of folders.
    notes = [line for line in err.splitlines() if line.strip()]
    assert len(notes) == 1, err
    assert notes[0].startswith("accelerate: 3 folder(s) written by Hugging Face accelerate")
    assert "optimizer steps" in notes[0] and "accelkit ckpt import" in notes[0]

    # One folder given alone is listed too.
    code, out, err = _cli(capsys, "ckpt", "ls", str(outputs / "step_10"), "--json")
    assert code == 0, err
    assert [(r["name"], r["state"], r["step"]) for r in json.loads(out)] == [
        ("step_10", "accelerate", steps)
    ]


def test_verify_checks_accelerate_folders_and_prune_explains_them_once_and_keeps_them(
    outputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.name for p in outputs.iterdir())
    # A pickled sampler object (use_seedable_sampler=True): read, never unpickled, and said.
    (outputs / "step_10" / "sampler.bin").write_bytes(b"a pickled SeedableRandomSampler")
    code, out, err = _cli(capsys, "ckpt", "verify", str(outputs))
    assert code == 0, err  # healthy: every file read, every pickle through the allow-list
    assert out.count("OK    ") == 3 and out.count("Hugging Face accelerate") == 1, out
    assert "3 of 3 checkpoint(s) intact." in out
    assert out.count("read but not parsed: sampler.bin") == 1, out
    # One folder given alone, as JSON: every file counted.
    code, out, err = _cli(capsys, "ckpt", "verify", str(outputs / "step_3"), "--json")
    assert code == 0, err
    [result] = json.loads(out)["checkpoints"]
    files = sorted(p.name for p in (outputs / "step_3").iterdir())
    assert (result["state"], result["result"], result["files"]) == ("accelerate", "ok", len(files))

    code, out, err = _cli(capsys, "ckpt", "prune", str(outputs), "--keep", "1", "--yes")
    assert code == 0, err
    assert err.count("Hugging Face accelerate") == 1 and "prune keeps them" in err, err
    assert "(3 kept: 3 written by Hugging Face accelerate)" in out, out
    assert sorted(p.name for p in outputs.iterdir()) == before


@pytest.mark.parametrize("damage", ["truncated", "hostile_pickle", "wrong_shape"])
def test_verify_names_the_damaged_file_of_an_accelerate_folder(
    outputs: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    bad = outputs / "step_10"
    if damage == "truncated":
        target = bad / "optimizer.bin"
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "hostile_pickle":
        # A pickle that would run code (os.system) were it unpickled: refused by the allow-list.
        target = bad / "scheduler.bin"

        class Hostile:
            def __reduce__(self) -> tuple[object, tuple[str]]:
                return (os.system, ("true",))

        torch.save({"last_epoch": Hostile()}, target)
    else:  # a well-formed pickle of what no scheduler's state_dict() is
        target = bad / "scheduler.bin"
        torch.save([1, 2, 3], target)
    code, out, err = _cli(capsys, "ckpt", "verify", str(outputs))
    assert code == 1, out
    assert f"FAIL  step_10\n      {target}: " in out, out  # the file, named
    assert out.count("OK    ") == 2 and "2 of 3 checkpoint(s) intact." in out
    assert "1 checkpoint(s)" in err and "failed" in err


def test_a_hostile_optimizer_file_leaves_step_unknown_and_says_why(
    outputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (outputs / "step_3" / "optimizer.bin").write_bytes(b"not a torch archive")
    code, out, err = _cli(capsys, "ckpt", "ls", str(outputs), "--json")
    assert code == 0, err
    steps = {r["name"]: r["step"] for r in json.loads(out)}
    assert steps["step_3"] is None and steps["step_10"] == 3
    assert "step_3: STEP unknown:" in err and "optimizer.bin" in err


def test_load_state_says_it_read_an_accelerate_checkpoint_without_logging_set_up(
    tmp_path: Path, saved: Path
) -> None:
    folder = tmp_path / "step_3"
    shutil.copytree(saved, folder)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # accelerate_run.py's accelkit mode: the same objects, load_state(folder), train on.
    proc = subprocess.run(
        [sys.executable, str(RUN_SCRIPT), "accelkit", str(tmp_path / "out"), "no", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [
        line for line in proc.stderr.splitlines() if "written by Hugging Face accelerate" in line
    ]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"Loaded {folder}") and "optimizer step 3" in lines[0]
    assert "accelkit ckpt import" in lines[0]
