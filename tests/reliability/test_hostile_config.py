"""Hostile launch config files end in one clear line from the real `accelkit` console script.

A config file is small YAML that ``accelkit launch`` reads before anything starts (the one given
with ``--config_file``, or the default one under ``$HF_HOME``). Here it is a 400-byte alias bomb
(9**9 references), keys of the wrong type, 100,000 levels of nesting, an alias cycle, a 2 MiB
file, a PNG, Latin-1 and UTF-16 text, a named pipe nobody writes to, ``/dev/zero``, a folder, a
YAML tag that would run code: each ends in exit status 2 within seconds, with the launch usage and
one error line naming the file and what is wrong, never a traceback and never a hang. Writing one
(``accelkit config``) never follows a symbolic link, never overwrites, never leaves half a file
(``python -m accelkit.cli.main config``, each in a process forked from one that imported torch,
which the command imports to count GPUs; the console script where the umask is tested).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.preloaded import Preloaded

pytestmark = pytest.mark.reliability

ACCELKIT = shutil.which("accelkit", path=os.path.dirname(sys.executable)) or "accelkit"


def _bomb(leaf: str = "num_processes") -> str:
    """The classic: nine levels of nine aliases each, 9**9 references in about 400 bytes."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + f"\n{leaf}: *i\n"


def _nested(depth: int) -> str:
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "x: 1\n"


TEXT_CASES: dict[str, tuple[str, str]] = {
    # name: (content, what the error line says)
    "alias-bomb-as-a-value": (_bomb(), "aliases"),
    "alias-bomb-in-a-section": (_bomb("fsdp_config:\n  fsdp_min_num_params"), "aliases"),
    "alias-bomb-under-an-unknown-key": (_bomb("bogus"), "aliases"),
    "alias-bomb-as-a-section": (_bomb("fsdp_config"), "aliases"),
    "alias-cycle": ("num_processes: &a [*a]\n", "cycle"),
    "int-key": ("distributed_type: 'NO'\n1: 2\n", "the key '1' at the top level"),
    "null-key": ("~: 2\n", "the key '~' at the top level (line 1) is read as a null"),
    "empty-key": (": 2\n", "not valid YAML"),
    "bool-key": ("yes: 2\n", "the key 'yes' at the top level (line 1) is read as a bool"),
    "float-key": ("1.5: 2\n", "is read as a float"),
    "list-key": ("? [num_processes]\n: 2\n", "is a list"),
    "mapping-key": ("? {a: 1}\n: 2\n", "is a mapping"),
    "int-key-in-a-section": ("fsdp_config:\n  5: x\n", "the key '5' in fsdp_config (line 2)"),
    "null-key-in-a-section": ("dynamo_config:\n  null: x\n", "in dynamo_config"),
    "duplicate-key": ("num_processes: 2\nnum_processes: 64\n", "appears twice"),
    "nesting-100000-deep": ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested more than"),
    "mappings-50-deep": (_nested(50), "nested more than"),
    "a-list": ("- num_processes\n- 2\n", "must hold a mapping"),
    "a-single-value": ("just some text\n", "must hold a mapping"),
    "5000-digit-integer": ("num_processes: " + "9" * 5000 + "\n", "cannot be converted"),
    "infinite-integer": ("num_processes: .inf\n", "expected an integer"),
    "huge-integer": ("num_processes: " + "9" * 4000 + "\n", "must be <="),
    "code-running-tag": (
        "num_processes: !!python/object/apply:os.system ['touch {marker}']\n",
        "not valid YAML",
    ),
    "control-character": ("num_processes: \x07\n", "is not allowed in YAML"),
    "unclosed-bracket": ("num_processes: [\n", "not valid YAML"),
    "900-KB-value": ("mixed_precision: " + "x" * 900_000 + "\n", "expected no, fp16 or bf16"),
    "900-KB-key": ("k" * 900_000 + ": 1\n", "not valid YAML"),  # over YAML's 1024 for a key
    "1000-character-key": ("k" * 1000 + ": 1\n", "is not a setting"),
    "list-as-distributed-type": ("distributed_type: [1, 2]\n", "distributed_type"),
}


def _launch(tmp_path: Path, *args: str, timeout: float = 60) -> tuple[int, str, float]:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    started = time.monotonic()
    proc = subprocess.run(
        [ACCELKIT, "launch", *args, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang fails here
        env={**os.environ, "HF_HOME": str(tmp_path / "hf")},
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def _assert_one_line_refusal(code: int, output: str, path: Path, expected: str) -> None:
    assert code == 2, output[:2000]
    assert "Traceback" not in output, output[:4000]
    assert output.startswith("usage: accelkit launch"), output[:2000]
    error = output.strip().splitlines()[-1]
    assert error.startswith("accelkit launch: error: "), output[:2000]
    # One line, naming the file, short whatever the file held.
    assert len(output.strip().splitlines()) == 2 and len(error) < 600, error[:2000]
    assert str(path) in error and expected in error, error


@pytest.mark.parametrize("case", sorted(TEXT_CASES))
def test_hostile_config_text_is_refused_in_one_line(tmp_path: Path, case: str) -> None:
    content, expected = TEXT_CASES[case]
    marker = tmp_path / "marker"
    path = tmp_path / "config.yaml"
    path.write_text(content.replace("{marker}", str(marker)), encoding="utf-8")
    code, output, elapsed = _launch(tmp_path, "--cpu", "--config_file", str(path))
    _assert_one_line_refusal(code, output, path, expected)
    assert elapsed < 30, elapsed  # the bomb used to hang for good
    assert not marker.exists()


def _write_bytes(data: bytes) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        path = tmp_path / "config.yaml"
        path.write_bytes(data)
        return path

    return make


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    os.mkfifo(path)  # nobody ever writes to it: opening it for reading would block forever
    return path


def _folder(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.mkdir()
    return path


FILE_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "2-MiB": (_write_bytes(b"# padding\n" * 210_000), "larger than 1048576 bytes (1 MiB)"),
    "png": (_write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"), "not a text file"),
    "latin-1": (_write_bytes("mixed_precision: café\n".encode("latin-1")), "not UTF-8 text"),
    "utf-16": (_write_bytes("num_processes: 2\n".encode("utf-16")), "not a text file"),
    "named-pipe": (_fifo, "not a regular file"),
    "dev-zero": (lambda tmp_path: Path("/dev/zero"), "not a regular file"),
    "folder": (_folder, "is a folder"),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_hostile_config_files_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    make, expected = FILE_CASES[case]
    path = make(tmp_path)
    code, output, _ = _launch(tmp_path, "--cpu", "--config_file", str(path), timeout=30)
    _assert_one_line_refusal(code, output, path, expected)


def test_the_default_config_file_is_bounded_too(tmp_path: Path) -> None:
    # Read without --config_file (and without --cpu, which skips it, as in the reference).
    path = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(_bomb())
    code, output, _ = _launch(tmp_path, "--num_processes", "1")
    _assert_one_line_refusal(code, output, path, "aliases")


def test_aliases_within_the_budget_still_work(tmp_path: Path) -> None:
    # Anchors are YAML; a hand-written file may share a value. Only expansion is bounded.
    path = tmp_path / "config.yaml"
    path.write_text(
        "distributed_type: 'NO'\nuse_cpu: &yes true\ndebug: false\nsame_network: *yes\n"
        "num_processes: 1\nmixed_precision: 'no'\n"
    )
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    proc = subprocess.run(
        [ACCELKIT, "launch", "--config_file", str(path), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HOME": str(tmp_path / "hf")},
    )
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Preloaded]:
    """Processes for ``accelkit config``, forked from one that imported torch once: each run
    paid 2.5-3.5 s of CPU importing it (to count GPUs), 11 s a run in the loaded suite."""
    env = {**os.environ, "HF_HOME": str(tmp_path_factory.mktemp("hf"))}
    with Preloaded(["torch", "accelkit"], env=env) as preloaded:
        yield preloaded


def _write_config(python: Preloaded, *args: str) -> subprocess.CompletedProcess[str]:
    """``accelkit config default ARGS`` (every caller names its ``--config_file``)."""
    done = python.run("-m", "accelkit.cli.main", "config", "default", *args, timeout=120)
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
    )  # fmt: skip


def _config(
    tmp_path: Path, *args: str, umask: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ACCELKIT, "config", "default", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HOME": str(tmp_path / "hf")},
        preexec_fn=None if umask is None else lambda: os.umask(umask),
    )


@pytest.mark.parametrize("dangling", [False, True], ids=["link-to-a-file", "dangling-link"])
def test_config_never_writes_through_a_symbolic_link(
    python: Preloaded, tmp_path: Path, dangling: bool
) -> None:
    victim = tmp_path / "victim.txt"
    if not dangling:
        victim.write_text("precious\n")
    link = tmp_path / "conf" / "config.yaml"
    link.parent.mkdir()
    link.symlink_to(victim)
    proc = _write_config(python, "--config_file", str(link))
    assert proc.returncode == 1 and "not overwriting" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_text() == "precious\n"
    assert link.is_symlink() and sorted(p.name for p in link.parent.iterdir()) == ["config.yaml"]


def test_config_to_an_unwritable_place_is_one_line(python: Preloaded, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    proc = _write_config(python, "--config_file", str(blocker / "config.yaml"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "cannot write" in proc.stderr and str(blocker) in proc.stderr
    assert blocker.read_text() == "not a folder\n"


def test_config_leaves_exactly_one_whole_file(python: Preloaded, tmp_path: Path) -> None:
    path = tmp_path / "conf" / "config.yaml"
    proc = _write_config(python, "--config_file", str(path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temporary left
    again = _write_config(python, "--config_file", str(path), "--mixed_precision", "bf16")
    assert again.returncode == 1 and sorted(p.name for p in path.parent.iterdir()) == [
        "config.yaml"
    ]
    assert "mixed_precision: 'no'" in path.read_text()


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644)], ids=["077", "022"])
def test_config_honours_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    # A config file may hold secrets: a user with umask 077 keeps it to themselves.
    path = tmp_path / "conf" / "config.yaml"
    proc = _config(tmp_path, "--config_file", str(path), umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(path.stat().st_mode) == mode
