"""What the issue-23 red team still broke after the fixes, one test per class of break.

Every run here is real: checkpoints saved by ``Accelerator.save_state``, crafted by editing
their files (and re-signing the manifest where the attack needs it), read by the ``accelkit``
command (its console script's ``sys.exit(main())``, or the installed script itself) or by
``load_state()`` in a child process (forked from one that imported the CLI, or torch, once:
``tests.helpers.preloaded``) whose stdout and stderr (tracebacks, warnings, log lines) are
checked as a terminal would receive them.

The classes:

- Errors and ``load_state()``'s warnings quoted a checkpoint's names raw and whole: a manifest
  listing a missing ``gone\\x1b]0;pwned\\x07.bin`` retitled the terminal from a traceback or a
  log line, one listing 100,000 of them wrote a 5 MB warning, and a committed folder named
  ``evil\\x1b[2J`` cleared the screen from ``No committed checkpoint``.
- ``accelkit ckpt ls``/``verify`` grew with a crafted manifest: 300,000 metrics, a 5 MB metric
  name or 200,000 tracker runs made one table row megabytes long, 200,000 missing files a
  megabytes-long reason; a metric named ``acc=0.99 loss`` showed a value it does not have; and
  ``verify`` copied the folder's listing once per file (20,000 files: the square of it).
- A manifest re-signed over a damaged safetensors header or JSON file passed ``ckpt verify``,
  so ``ckpt prune --keep 1`` kept it as the newest intact checkpoint and deleted the only one
  ``load_state()`` could restore.
- Arguments: ``-o KEY=[[[[...`` (too deep for JSON) ended in a RecursionError traceback, an
  unknown flag holding ESC reached the terminal raw, and ``num_processes: 100000000`` in a
  launch config file made torchrun build settings for minutes and GiBs with nothing on screen.
- Ctrl-C at ``accelkit config``'s prompt (or while any command starts) printed a
  ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit._text import escape
from accelkit.checkpointing.formats.manifest import Manifest, verify_files
from accelkit.checkpointing.storage import get_storage
from tests.helpers.preloaded import Preloaded

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
ACCELKIT = Path(sys.executable).with_name("accelkit")
TITLE = "\x1b]0;pwned\x07"
GONE = f"gone{TITLE}.bin"
FOLDER = "evil\x1b[2J\u202e"
BOUND = 20_000  # characters: a few screens, whatever the checkpoint holds


def _env(tmp_path: Path | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONIOENCODING": "utf-8",  # strict: an unescaped surrogate would raise
    }
    if tmp_path is not None:
        env["HF_HOME"] = str(tmp_path / "hf")
    return env


def _printable(raw: bytes, what: str) -> str:
    text = raw.decode("utf-8")
    bad = sorted({c for c in text if c != "\n" and not c.isprintable()})
    assert not bad, f"{what} printed raw {bad!r}:\n{text[-3000:]}"
    return text


# What the installed console script runs.
_CLI = "import sys\nfrom accelkit.cli.main import main\nsys.exit(main())\n"


@pytest.fixture(scope="module")
def cli() -> Iterator[Preloaded]:
    """``accelkit`` as its console script runs it, in fresh processes (forked from one that
    imported the CLI once): the bytes it writes to its stdout and stderr, and its exit code."""
    from accelkit.cli.main import _SUBCOMMANDS

    with Preloaded(["accelkit.cli.main", *_SUBCOMMANDS], env=_env(), cwd=ROOT) as preloaded:
        yield preloaded


def _accelkit(cli: Preloaded | None, *args: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``accelkit *args`` (``cli=None``: the installed console script itself)."""
    if cli is None:
        done = subprocess.run(
            [str(ACCELKIT), *args], capture_output=True, env=_env(), timeout=timeout, check=False
        )
    else:
        done = cli.run("-c", _CLI, *args, timeout=timeout)
    out = _printable(done.stdout, f"accelkit {args[:2]}")
    err = _printable(done.stderr, f"accelkit {args[:2]}")
    assert "Traceback" not in out + err, err[-3000:]
    return done.returncode, out, err


def _save(project: Path, count: int = 3) -> None:
    """``count`` checkpoints; checkpoint ``i`` holds weights filled with ``i + 1``."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    model = accelerator.prepare(nn.Linear(2, 2))
    accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    for i in range(count):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i + 1))
        accelerator.save_state(metrics={"loss": 0.5})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = tmp_path_factory.mktemp("redteam") / "project"
    _save(project)
    return project


def _copy(saved: Path, tmp_path: Path) -> Path:
    project = tmp_path / "project"
    subprocess.run(["cp", "-a", str(saved), str(project)], check=True)
    return project


def _ckpt(project: Path, n: int) -> Path:
    return project / "checkpoints" / f"checkpoint_{n}"


def _edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / "accelkit.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _resign(folder: Path) -> None:
    """Make the manifest match the files as they are now: the attacker's re-signing."""

    def sign(manifest: dict[str, Any]) -> None:
        for entry in manifest["files"]:
            data = (folder / entry["path"]).read_bytes()
            entry["size"] = len(data)
            entry["checksum"] = "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)

    _edit_manifest(folder, sign)


def _missing(count: int) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        checksum = manifest["files"][0]["checksum"]
        manifest["files"] += [
            {"path": f"{GONE}{i}", "size": 3, "checksum": checksum} for i in range(count)
        ]

    return edit


_LOADER = """
import logging, sys
logging.basicConfig(level=logging.INFO)
import torch
from torch import nn
from accelkit import Accelerator, ProjectConfiguration
config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
accelerator = Accelerator(project_config=config, cpu=True)
model = accelerator.prepare(nn.Linear(2, 2))
accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
accelerator.load_state(*sys.argv[2:])
print("restored", model.weight.flatten()[0].item())
"""


@pytest.fixture(scope="module")
def python() -> Iterator[Preloaded]:
    """Fresh ``python -c`` children (forked from one that imported torch and accelkit once)."""
    modules = ["torch", "torch._dynamo", "accelkit", "accelkit.checkpointing.tiered"]
    with Preloaded(modules, env=_env(), cwd=ROOT) as preloaded:
        yield preloaded


def _load_state(python: Preloaded, project: Path, *path: str) -> tuple[str, str]:
    """``load_state`` in a child with logging on: (stdout, stderr proven printable)."""
    done = python.run("-c", _LOADER, str(project), *path, timeout=300)
    return done.stdout.decode(), _printable(done.stderr, "load_state")


# --------------------------------------------------------------------------- class 1

LOAD_CASES = {
    # name: (how the newest checkpoint is damaged, explicit path?, restored weight or None)
    "newest lists a hostile missing file": (_missing(1), False, 2.0),
    "newest lists 100,000 hostile missing files": (_missing(100_000), False, 2.0),
    "the damaged one passed to load_state": (_missing(1), True, None),
}


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_load_state_errors_and_warnings_are_escaped_and_bounded(
    python: Preloaded, saved: Path, tmp_path: Path, case: str
) -> None:
    edit, explicit, restored = LOAD_CASES[case]
    project = _copy(saved, tmp_path)
    _edit_manifest(_ckpt(project, 2), edit)
    out, err = _load_state(python, project, *([str(_ckpt(project, 2))] if explicit else []))
    assert escape(f"{GONE}0") in err  # named, escaped
    assert len(err) < BOUND, len(err)
    if restored is None:
        assert "CorruptCheckpointError" in err and "restored" not in out
    else:
        assert "Not resuming from" in err and f"restored {restored}" in out
        if "100,000" in case:
            assert "... and 99,995 more" in err


def test_no_committed_checkpoint_error_escapes_folder_names(
    python: Preloaded, saved: Path, tmp_path: Path
) -> None:
    project = _copy(saved, tmp_path)
    for n in (0, 1):
        subprocess.run(["rm", "-r", str(_ckpt(project, n))], check=True)
    _ckpt(project, 2).rename(project / "checkpoints" / FOLDER)
    out, err = _load_state(python, project)
    assert "CheckpointPathError: No committed checkpoint" in err and escape(FOLDER) in err
    assert "restored" not in out


def test_checkpoint_error_text_is_bounded_but_keeps_both_ends() -> None:
    from accelkit.checkpointing.errors import CorruptCheckpointError

    message = f"start {TITLE}" + "x; " * 2_000_000 + "the fix"
    error = CorruptCheckpointError(message)
    assert len(str(error)) <= 4000 and str(error).isprintable()
    assert str(error).startswith("start \\x1b]0;pwned\\x07") and str(error).endswith("the fix")
    assert error.args[0] == message  # the exact text stays available to code


# --------------------------------------------------------------------------- class 2


def _metrics(count: int) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.__setitem__("metrics", {f"m{i}{TITLE}": float(i) for i in range(count)})


def _runs(count: int) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.__setitem__("experiment", {"runs": {f"t{i}": {} for i in range(count)}})


TABLE_CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    "300,000 metrics": _metrics(300_000),
    "a 5 MB metric name": lambda m: m.__setitem__("metrics", {"l" * 5_000_000: 1.0}),
    "200,000 tracker runs": _runs(200_000),
    "200,000 missing files": _missing(200_000),
}


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_ls_and_verify_stay_bounded_for_a_crafted_manifest(
    cli: Preloaded, saved: Path, tmp_path: Path, case: str
) -> None:
    project = _copy(saved, tmp_path)
    _edit_manifest(_ckpt(project, 2), TABLE_CASES[case])
    code, out, err = _accelkit(cli, "ckpt", "ls", str(project))
    assert code == 0 and len(out) + len(err) < BOUND, (len(out), len(err))
    assert len(out.splitlines()) == 4  # the header and one row per checkpoint
    code, out, err = _accelkit(cli, "ckpt", "verify", str(project))
    assert len(out) + len(err) < BOUND, (len(out), len(err))
    if "missing" in case:
        assert code == 1 and "... and 199,950 more" in out
    # --json is for programs: the exact values, in full.
    code, out, _ = _accelkit(cli, "ckpt", "ls", str(project), "--json")
    listed = json.loads(out)[2]
    manifest = json.loads((_ckpt(project, 2) / "accelkit.json").read_text())
    if "missing" not in case:
        assert listed["metrics"] == manifest["metrics"]
        runs = manifest.get("experiment", {}).get("runs", {})
        assert listed["experiment"].get("runs", {}) == runs


def test_a_metric_name_cannot_fake_another_value(
    cli: Preloaded, saved: Path, tmp_path: Path
) -> None:
    project = _copy(saved, tmp_path)
    _edit_manifest(_ckpt(project, 2), lambda m: m.__setitem__("metrics", {"acc=0.99 loss": 5.0}))
    code, out, _ = _accelkit(cli, "ckpt", "ls", str(project))
    row = out.splitlines()[3]
    assert code == 0 and "acc?0.99?loss=5" in row and "acc=0.99" not in row


class _CountingListing(Mapping[str, int]):
    """A folder listing that counts how often it is walked whole."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes, self.walks = sizes, 0

    def __getitem__(self, key: str) -> int:
        return self.sizes[key]

    def __iter__(self) -> Iterator[str]:
        self.walks += 1
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def test_verify_reads_the_listing_without_copying_it_per_file(saved: Path) -> None:
    folder = str(_ckpt(saved, 2))
    storage = get_storage(folder)
    manifest = Manifest.from_json((_ckpt(saved, 2) / "accelkit.json").read_text())
    listing = _CountingListing(storage.walk_files(folder))
    assert verify_files(storage, folder, manifest, sizes=listing) == []
    # `ckpt verify` calls it once per file: a copy each time cost (files x listing).
    assert listing.walks == 0


def test_verify_of_20000_listed_and_20000_extra_files_is_quick(
    cli: Preloaded, saved: Path, tmp_path: Path
) -> None:
    project = _copy(saved, tmp_path)
    folder = _ckpt(project, 2)
    _edit_manifest(folder, _missing(20_000))
    for i in range(20_000):
        (folder / f"extra{i}").write_bytes(b"")
    started = time.monotonic()
    code, out, _ = _accelkit(cli, "ckpt", "verify", str(folder))
    # Quadratic, this took 4 s on an idle 2-core machine and 100 s at 100,000 files.
    assert code == 1 and time.monotonic() - started < 60
    assert "... and 19,950 more" in out and "... and 19,980 more" in out


# --------------------------------------------------------------------------- class 3


def _garbage_header(path: Path) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8] + b"{" * length + raw[8 + length :])


RESIGNED = {
    "model.safetensors header": ("model.safetensors", _garbage_header),
    "random states header": ("random_states_0.safetensors", _garbage_header),
    "random states JSON": ("random_states_0.json", lambda p: p.write_text("{not json")),
    "optimizer JSON": ("optimizer.json", lambda p: p.write_text("[" * 200 + "]" * 200)),
}


@pytest.mark.parametrize("case", sorted(RESIGNED))
def test_a_resigned_damaged_file_fails_verify_and_prune_keeps_the_intact_one(
    cli: Preloaded, python: Preloaded, saved: Path, tmp_path: Path, case: str
) -> None:
    name, damage = RESIGNED[case]
    project = _copy(saved, tmp_path)
    newest = _ckpt(project, 2)
    damage(newest / name)
    _resign(newest)
    code, out, _ = _accelkit(cli, "ckpt", "verify", str(newest))
    assert code == 1 and f"FAIL  checkpoint_2\n      {name}: " in out, out
    code, out, err = _accelkit(cli, "ckpt", "prune", str(project), "--keep", "1", "--yes")
    assert code == 0, err
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == [
        "checkpoint_1",
        "checkpoint_2",
    ]
    out, err = _load_state(python, project)
    assert "restored 2.0" in out, err[-3000:]  # checkpoint_1's weights


def test_an_intact_checkpoint_still_verifies(saved: Path) -> None:
    code, out, _ = _accelkit(None, "ckpt", "verify", str(saved))
    assert code == 0 and "3 of 3 checkpoint(s) intact." in out


# --------------------------------------------------------------------------- class 4


def test_storage_option_too_deep_for_json_is_text(cli: Preloaded, tmp_path: Path) -> None:
    deep = "endpoint_url=" + "[" * 100_000
    for command in ("ls", "verify", "import"):
        code, _, err = _accelkit(cli, "ckpt", command, "-o", deep, str(tmp_path / "nothing"))
        assert code == 2 and "does not exist" in err, err[-2000:]


def test_an_unknown_flag_is_escaped() -> None:
    for argv in (["launch", "--\x1b[2Jx", "train.py"], ["ckpt", "ls", f"--{TITLE}", "."]):
        code, _, err = _accelkit(None, *argv)
        assert code == 2 and "\\x1b" in err, err


@pytest.mark.parametrize(
    "setting, value, expected",
    [
        ("num_processes", "100000000", "more than 4096 per machine"),
        ("num_processes", "8193", "more than 4096 per machine"),
        ("main_process_port", "70000", "must be <= 65535"),
    ],
)
@pytest.mark.parametrize("where", ["config file", "flag"])
def test_absurd_launch_sizes_are_refused_at_once(
    cli: Preloaded, tmp_path: Path, setting: str, value: str, expected: str, where: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    if where == "flag":
        args = [f"--{setting}", value]
    else:
        config = tmp_path / "config.yaml"
        config.write_text(f"{setting}: {value}\nuse_cpu: true\n")
        args = ["--config_file", str(config)]
    started = time.monotonic()
    code, _, err = _accelkit(cli, "launch", "--cpu", *args, str(script), timeout=60)
    assert code == 2 and expected in err and setting in err, err
    assert time.monotonic() - started < 30


# --------------------------------------------------------------------------- class 5


def _as_at_a_terminal() -> None:
    """Ctrl-C as a person's shell leaves it: a job started in the background of a
    non-interactive shell (a CI runner's ``cmd &``) inherits SIGINT ignored, and a command
    rightly keeps an ignored SIGINT ignored, so the test would wait on it for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(
    argv: list[str], tmp_path: Path, delay: float, terminal: bool, prompt: bytes | None = None
) -> tuple[int, str]:
    """Run ``accelkit *argv``, SIGINT it ``delay`` s after it printed ``prompt`` (or after
    its start, without one); (exit code, all it printed)."""
    if terminal:  # a real terminal: the prompt waits on it as for a person
        controller, tty = pty.openpty()
        proc = subprocess.Popen(
            [str(ACCELKIT), *argv],
            stdin=tty,
            stdout=tty,
            stderr=tty,
            env=_env(tmp_path),
            preexec_fn=_as_at_a_terminal,
        )
        os.close(tty)
    else:
        proc = subprocess.Popen(
            [str(ACCELKIT), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env(tmp_path),
            preexec_fn=_as_at_a_terminal,
        )
    output = b""
    if prompt is None:
        # Past the interpreter's own start and accelkit's imports (a signal there is Python's
        # to report, before any code of accelkit runs), however loaded the machine is.
        _wait_for_cpu(proc, _STARTED_CPU_SECONDS)
        time.sleep(delay)
    else:  # at the prompt, however long the start took on a loaded machine
        fd = controller if terminal else proc.stdout.fileno()  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while prompt not in output and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                output += os.read(fd, 65536)
        assert prompt in output, output
        time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=30)
    if not terminal:
        assert proc.stdout is not None
        return code, (output + proc.stdout.read()).decode()
    try:
        while chunk := os.read(controller, 65536):
            output += chunk
    except OSError:  # the other end is closed
        pass
    os.close(controller)
    return code, output.decode()


# CPU time a command has used once `accelkit.cli.main` is imported and its own code runs: the
# interpreter's start and that import take about 0.05 s here; each command below then imports
# for a second or more (torch, the storage layer), so it is still working when the signal comes.
_STARTED_CPU_SECONDS = 0.3


def _wait_for_cpu(proc: subprocess.Popen[bytes], seconds: float, timeout: float = 60) -> None:
    """Wait until ``proc`` has used ``seconds`` of CPU time (or ended)."""
    ticks = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        if (int(fields[11]) + int(fields[12])) / ticks >= seconds:  # utime + stime
            return
        time.sleep(0.01)


@pytest.mark.parametrize(
    "argv, delay, terminal",
    [
        (["config"], 0.5, True),
        (["config"], 0.5, False),
        (["config", "default"], 0.2, False),
        (["env"], 0.2, False),
        (["ckpt", "ls", "."], 0.2, False),
    ],
    ids=["config-prompt-on-a-terminal", "config-prompt-on-a-pipe", "config-default", "env", "ls"],
)
def test_ctrl_c_ends_in_one_line(
    tmp_path: Path, argv: list[str], delay: float, terminal: bool
) -> None:
    config = tmp_path / "conf" / "config.yaml"
    if argv[0] == "config":
        argv = [argv[0], "--config_file", str(config), *argv[1:]]
    at_prompt = argv[0] == "config" and argv[-1] != "default"
    prompt = b"How will the script run" if at_prompt else None
    code, output = _interrupt(argv, tmp_path, delay, terminal, prompt)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    # A command may finish before the signal arrives (config default and ls are quick);
    # interrupted, it says so in its last line and exits 130.
    if code == 130:
        assert output.rstrip().endswith("accelkit: interrupted; stopped."), output
    else:
        assert code in (0, 1) and "interrupted" not in output, (code, output)
    if prompt is not None:  # at the prompt: it cannot have finished
        assert code == 130, (code, output)
    if argv[0] == "config" and config.parent.exists():
        # Nothing half-written: no temporary, and a config file only if it is whole.
        names = sorted(p.name for p in config.parent.iterdir())
        assert names in ([], ["config.yaml"]), names
        if names:
            assert "num_processes" in config.read_text()


# --------------------------------------------------------------------------- class 6

_SAVER = """
import sys
from torch import nn
from accelkit import Accelerator, ProjectConfiguration
config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
accelerator = Accelerator(project_config=config, cpu=True)
accelerator.prepare(nn.Linear(2, 2))
accelerator.save_state()
print("saved")
"""


@pytest.mark.parametrize("kind", ["named pipe", "folder"])
def test_a_planted_save_lock_never_blocks_a_save(
    cli: Preloaded, python: Preloaded, tmp_path: Path, kind: str
) -> None:
    """``.accelkit-run.lock`` as a named pipe: opening it waited for a writer forever (save and
    import hung). It is now read as a file that is not one: an unreadable lock (stale), taken
    over; a folder there cannot be, and the save says which path is in the way."""
    project = tmp_path / "project"
    project.mkdir()
    lock = project / ".accelkit-run.lock"
    if kind == "named pipe":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    done = python.run("-c", _SAVER, str(project), timeout=60)  # a hang fails here
    err = _printable(done.stderr, "save_state")
    if kind == "named pipe":
        assert done.stdout.decode().strip() == "saved", err[-3000:]
        assert (project / "checkpoints" / "checkpoint_0" / "accelkit.json").is_file()
        code, out, _ = _accelkit(cli, "ckpt", "verify", str(project))
        assert code == 0, out
    else:
        assert "saved" not in done.stdout.decode()
        assert str(lock) in err.strip().splitlines()[-1], err[-3000:]
        assert lock.is_dir()  # not deleted: accelkit did not make it
