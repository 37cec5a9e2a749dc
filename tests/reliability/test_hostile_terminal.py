"""Nothing the CLI prints from a checkpoint can act on the terminal (issue 23, item 8).

The attack: escape sequences in a metric name, a folder or file name, a tensor name, safetensors
metadata or a foreign (Accelerate-like) file name reached the terminal raw through ``ls``,
``verify``, ``prune`` and ``inspect``: a window title changed (``ESC ] 0 ;``), the screen cleared
(``ESC [ 2 J``), text hidden (``ESC [ 8 m``) so that a ``corrupt`` state could not be seen.
Only the RUNS column was filtered. Every run here is the real ``accelkit`` console script; its
stdout and stderr bytes must decode as UTF-8 (a non-UTF-8 file name would otherwise make
``print`` raise, or pass raw bytes) and hold no character that is not printable but ``\\n``:
no C0/C1 control, no DEL, no bidi override, no zero-width character. The names must still be
shown (escaped, ``\\x1b``), and ``--json`` must give them back exactly as they are on disk.
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
from safetensors.torch import save_file
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit._text import escape, short

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
ACCELKIT = Path(sys.executable).with_name("accelkit")

TITLE = "\x1b]0;pwned\x07"
METRIC = f"loss{TITLE}\x1b[8m"
FOLDER = "evil\x1b[2J\u202e"  # clears the screen, then reverses what follows
EXTRA = "notes\x1b[8mhidden\x9b\x7f.txt"  # hide, C1 CSI, DEL
RAW_NAME = b"raw\xff\x1b.bin"  # not UTF-8: a lone surrogate once decoded
GONE = f"gone{TITLE}.bin"
FOREIGN = "x\u200b\x1b[1A.txt"  # zero-width space, cursor up
TENSOR = "w\x1b[2J\u202egol"
META = f"made by {TITLE}"


def _accelkit(*args: str) -> tuple[int, str, str]:
    """Run the console script; ``(exit code, stdout, stderr)`` once both are proven clean."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONIOENCODING": "utf-8",  # strict: an unescaped surrogate would raise
    }
    done = subprocess.run(
        [str(ACCELKIT), *args], capture_output=True, env=env, timeout=120, check=False
    )
    return done.returncode, _clean(done.stdout, args), _clean(done.stderr, args)


def _clean(raw: bytes, args: tuple[str, ...]) -> str:
    text = raw.decode("utf-8")
    bad = sorted({c for c in text if c != "\n" and not c.isprintable()})
    assert not bad, f"accelkit {' '.join(args)!r} printed raw {bad!r}:\n{text}"
    assert "Traceback" not in text, text
    return text


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint_0/1 saved with a hostile metric name; checkpoint_1 also holds a hostile and a
    non-UTF-8 file name; a copy of it in a hostile folder name; checkpoint_2 corrupt (its
    manifest lists a missing hostile name); checkpoint_3 a folder accelkit did not write."""
    project = tmp_path_factory.mktemp("terminal") / "project"
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    model = accelerator.prepare(nn.Linear(2, 2))
    assert model is not None
    for _ in range(3):
        accelerator.save_state(metrics={METRIC: 0.5})
    checkpoints = project / "checkpoints"
    one = checkpoints / "checkpoint_1"
    (one / EXTRA).write_bytes(b"x")
    with open(os.path.join(os.fsencode(one), RAW_NAME), "wb") as file:
        file.write(b"y")
    shutil.copytree(checkpoints / "checkpoint_0", checkpoints / FOLDER)
    manifest_path = checkpoints / "checkpoint_2" / "accelkit.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].append(
        {"path": GONE, "size": 3, "checksum": manifest["files"][0]["checksum"]}
    )
    manifest_path.write_text(json.dumps(manifest))
    foreign = checkpoints / "checkpoint_3"
    foreign.mkdir()
    (foreign / FOREIGN).write_bytes(b"z")
    return project


def test_ls_table_and_stderr_escape_every_name(project: Path) -> None:
    code, out, err = _accelkit("ckpt", "ls", str(project))
    assert code == 0
    assert escape(METRIC) in out and escape(FOLDER) in out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "corrupt" in rows["checkpoint_2"] and "foreign" in rows["checkpoint_3"]
    assert escape(GONE) in err and "corrupt" in err  # the reason, and the state, are visible
    assert escape(FOREIGN) in err


def test_ls_json_round_trips_the_exact_names(project: Path) -> None:
    code, out, _ = _accelkit("ckpt", "ls", str(project), "--json")
    assert code == 0 and out.isascii()
    listed = {item["name"]: item for item in json.loads(out)}
    assert FOLDER in listed  # the true name, for scripts
    assert listed["checkpoint_0"]["metrics"] == {METRIC: 0.5}
    assert GONE in listed["checkpoint_2"]["error"]


def test_verify_escapes_problems_extra_files_and_undecodable_names(project: Path) -> None:
    code, out, err = _accelkit("ckpt", "verify", str(project))
    assert code == 1  # checkpoint_2 fails
    assert f"FAIL  checkpoint_2\n      {escape(GONE)}" in out
    assert escape(EXTRA) in out
    assert "raw\\udcff\\x1b.bin" in out  # the non-UTF-8 byte, shown as its surrogate
    assert f"OK    {escape(FOLDER)}" in out
    assert "SKIP  checkpoint_3" in out and escape(FOREIGN) in out
    assert "failed" in err


def test_errors_raised_below_the_cli_are_escaped(project: Path) -> None:
    # A Fail carrying the catalog's description of a foreign folder (its file names).
    code, _, err = _accelkit("ckpt", "verify", str(project / "checkpoints" / "checkpoint_3"))
    assert code == 1 and "error:" in err and escape(FOREIGN) in err
    # A path that does not exist, named by the user but holding the same bytes.
    code, _, err = _accelkit("ckpt", "ls", str(project / FOLDER / "nothing"))
    assert code == 2 and "does not exist" in err


def test_prune_escapes_kept_and_planned_names(project: Path) -> None:
    code, out, err = _accelkit("ckpt", "prune", str(project), "--keep", "1", "--dry-run")
    assert code == 0
    assert "Keeping corrupt checkpoint_2" in err and escape(GONE) in err
    assert "Keeping checkpoint_3" in err and escape(FOREIGN) in err
    assert "Would remove" in out


def test_inspect_escapes_tensor_names_metadata_and_header_errors(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({TENSOR: torch.zeros(2)}, str(folder / "model.safetensors"), metadata={"n": META})
    code, out, _ = _accelkit("ckpt", "inspect", str(folder))
    assert code == 0 and escape(TENSOR) in out
    code, out, _ = _accelkit("ckpt", "inspect", str(folder), "--json")
    payload = json.loads(out)
    assert code == 0 and out.isascii()
    assert payload["tensors"][0]["name"] == TENSOR
    assert payload["files"][0]["metadata"] == {"n": META}
    bad = f"bad{TITLE}.safetensors"
    (folder / bad).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    code, _, err = _accelkit("ckpt", "inspect", str(folder))
    assert code == 1 and escape(bad) in err


# ---------------------------------------------------------------- the one escape


@pytest.mark.parametrize(
    "char",
    ["\x00", "\x07", "\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\x9b", "\u200b", "\u200f",
     "\u202e", "\u2066", "\u2028", "\ufeff", "\udcff", "\U000e0001"],
)  # fmt: skip
def test_escape_covers_every_dangerous_character(char: str) -> None:
    shown = escape(f"a{char}b")
    assert shown.isprintable() and shown.isascii() and shown != f"a{char}b"
    assert escape(shown) == shown  # idempotent: a second pass (the printer) changes nothing
    assert shown[1:-1] == repr(char)[1:-1]  # the escape repr uses


def test_escape_leaves_printable_text_and_reprs_alone() -> None:
    for text in ("checkpoint_3", "日本語 ünïcödé", "C:\\path\\x1b", repr("a\x1bb")):
        assert escape(text) == text
    assert short("\x1b]0;t\x07" * 40, limit=20) == "'\\x1b]0;t\\x07\\x1b..."
    assert short(["\u202e"]) == "['\\u202e']"
