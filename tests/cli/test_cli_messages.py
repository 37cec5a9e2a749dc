"""What the real ``accelkit`` console script says when it is used wrongly, or a launched job
fails: the subcommand's own usage and flags, what is missing with an example, and one last line
naming the rank and the error of a failed worker."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The console script installed beside the interpreter; with PYTHONPATH it runs this tree's code.
ACCELKIT = str(Path(sys.executable).with_name("accelkit"))


@pytest.fixture(autouse=True)
def _no_user_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A config file in the developer's own ~/.cache/huggingface must not change these runs.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def _accelkit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ACCELKIT, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ),
        timeout=180,
        check=False,
    )


@pytest.mark.slow
def test_unknown_flag_gets_the_subcommands_usage_and_its_nearest_flag() -> None:
    proc = _accelkit("ckpt", "ls", "X", "--jsn")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: accelkit ckpt ls ")
    assert "did you mean --json?" in proc.stderr
    assert "--version" not in proc.stderr  # the top level's flag is not the nearest here
    proc = _accelkit("ckpt", "verify", "X", "--jsn")
    assert proc.returncode == 2 and proc.stderr.startswith("usage: accelkit ckpt verify ")
    assert "accelkit ckpt verify: error: unrecognized argument --jsn" in proc.stderr


@pytest.mark.slow
def test_refused_launch_flags_are_explained_by_launch_only() -> None:
    proc = _accelkit("ckpt", "ls", "X", "--use_deepspeed")
    assert proc.returncode == 2 and "DeepSpeed" not in proc.stderr
    assert "unrecognized argument --use_deepspeed" in proc.stderr
    proc = _accelkit("launch", "--use_deepspeed", "train.py")
    assert proc.returncode == 2 and "DeepSpeed is not supported" in proc.stderr


@pytest.mark.slow
def test_launch_without_a_script_names_what_is_missing(tmp_path: Path) -> None:
    proc = _accelkit("launch", "--cpu", "--num_processes", "2", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: accelkit launch ")
    assert "required" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("accelkit launch: error: no script to run")
    assert "accelkit launch --cpu --num_processes 2 train.py" in last
    # With a script, what follows it is still the script's.
    (tmp_path / "show.py").write_text("import sys; print(sys.argv[1:])\n")
    proc = _accelkit("launch", "--cpu", "show.py", "--lr", "1", "-m", "x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['--lr', '1', '-m', 'x']"


@pytest.mark.slow
def test_top_level_help_names_every_ckpt_action() -> None:
    from accelkit.cli.main import build_parser

    def actions_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    actions = actions_of(actions_of(build_parser())["ckpt"])
    assert set(actions) >= {"ls", "prune", "verify", "inspect", "import"}
    proc = _accelkit("--help")
    assert proc.returncode == 0
    ckpt_line = proc.stdout[proc.stdout.index("    ckpt ") :]
    for name in actions:
        assert name in ckpt_line, name


@pytest.mark.slow
def test_config_without_a_terminal_says_what_it_wrote(tmp_path: Path) -> None:
    target = tmp_path / "cfg.yaml"
    proc = _accelkit("config", "--config_file", str(target))
    assert proc.returncode == 0, proc.stderr
    assert target.is_file()
    said = proc.stderr.strip().splitlines()[-1]
    assert said.startswith("accelkit config: stdin had no answer for 3 question(s)")
    assert str(target) in said
    assert "How will the script run: NO" in said and "Mixed precision: no" in said
    # Answers given on a pipe are answers: nothing to warn about.
    again = subprocess.run(
        [ACCELKIT, "config", "--config_file", str(tmp_path / "b.yaml")],
        input="NO\nyes\nbf16\n",
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert again.returncode == 0 and again.stderr == "", again.stderr


FAILING = """\
import os, sys, time

rank = int(os.environ["RANK"])
if rank == 1:
    if sys.argv[1:] == ["exit"]:
        sys.exit(3)

    class CheckpointError(Exception):
        pass

    raise CheckpointError("cannot write /ckpt/x: [Errno 28] No space left on device\\n\\x1b[2J")
time.sleep(2)  # rank 0 is still running when rank 1 fails: torchrun stops it (SIGTERM)
"""


@pytest.mark.slow
def test_a_failed_worker_is_named_in_the_last_line(tmp_path: Path) -> None:
    (tmp_path / "fails.py").write_text(FAILING)
    proc = _accelkit("launch", "--cpu", "--num_processes", "2", "fails.py", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # the worker's exit code
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "accelkit launch: rank 1 failed: CheckpointError: cannot write /ckpt/x: [Errno 28] "
        "No space left on device\\n\\x1b[2J"
    )
    # The worker's traceback reads as python's own: the start-up frames are not in it.
    assert f'File "{tmp_path / "fails.py"}", line 11, in <module>' in proc.stderr
    assert "runpy" not in proc.stderr and "_failure.py" not in proc.stderr
    # A worker that exits with a code of its own: that code, and the line says so.
    proc = _accelkit("launch", "--cpu", "--num_processes", "2", "fails.py", "exit", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "accelkit launch: rank 1 failed: exit code 3"


@pytest.mark.slow
def test_one_process_and_a_module_get_the_line_too(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import sys\n"
        "print(sys.argv[0].endswith('train.py'), sys.argv[1:])\n"
        "raise ValueError('x' * 5000)\n"
    )
    proc = _accelkit("launch", "--cpu", "-m", "pkg.train", "--lr", "1", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout.strip() == "True ['--lr', '1']"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("accelkit launch: rank 0 failed: ValueError: xxx")
    assert last.endswith("...") and len(last) < 500  # cut to a sane length
    assert "runpy" not in proc.stderr


def test_a_wrong_type_error_is_a_message_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ``WrongTypeError`` is accelkit refusing input on purpose (with its fix): the ckpt
    commands print it on one line and exit 2; a plain ``TypeError`` is still a bug of ours and
    keeps its traceback."""

    from accelkit.cli._ckpt_common import command
    from accelkit.errors import WrongTypeError

    def refuse(args: argparse.Namespace) -> int:
        raise WrongTypeError("keep=<list>: expected a whole number; pass --keep 3")

    def bug(args: argparse.Namespace) -> int:
        raise TypeError("unsupported operand")

    args = argparse.Namespace(path="/runs/x")
    assert command("ls", refuse)(args) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "accelkit ckpt ls: error: keep=<list>: expected a whole number; pass --keep 3"
    )
    with pytest.raises(TypeError, match="unsupported operand"):
        command("ls", bug)(args)


def _wrapped_interrupt() -> RuntimeError:
    """What Python raises when Ctrl-C lands in a class body's ``__set_name__`` while a module
    is imported (seen when a SIGINT reached `accelkit env` during `import platform`)."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Error calling __set_name__ on 'cached_property'") from interrupt
    except RuntimeError as error:
        return error


@pytest.mark.parametrize("where", ["while the parser is built", "in the command"])
def test_a_ctrl_c_wrapped_by_python_is_still_one_line(
    where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelkit.cli import main as cli

    def fail(*args: object) -> int:
        raise _wrapped_interrupt()

    if where == "while the parser is built":
        monkeypatch.setattr(cli, "build_parser", fail)
    else:
        parser = cli.build_parser()
        parser.parse_known_args(["env"])[0]._parser.set_defaults(func=fail)  # env's own parser
        monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["env"]) == 130
    err = capsys.readouterr().err
    assert err == "accelkit: interrupted; stopped.\n", err


def test_a_runtime_error_not_caused_by_ctrl_c_is_not_called_an_interrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelkit.cli import main as cli

    def fail() -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr(cli, "build_parser", fail)
    with pytest.raises(RuntimeError, match="a defect"):
        cli.main(["env"])
