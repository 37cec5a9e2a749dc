"""One error family: every exception accelkit defines hangs under ``AccelkitError``, and only
those that mean "a bad argument" are ``ValueError`` (the rule of :mod:`accelkit.errors`)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import accelkit
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.storage import StorageError
from accelkit.errors import AccelkitError, ConfigurationError
from accelkit.trackers.delivery.failures import TrackerError

REPO = Path(__file__).resolve().parent.parent

PACKAGE = Path(accelkit.__file__).resolve().parent
# Exceptions that are not accelkit's to root: private control flow caught where it is raised.
PRIVATE = {"_Refused", "Fail"}


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [
            n.name
            for n in tree.body
            if isinstance(n, ast.ClassDef) and n.name not in PRIVATE and n.bases
        ]
        if not names:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = importlib.import_module(".".join(p for p in parts if p != "__init__"))
        for name in names:
            cls = getattr(module, name, None)
            if (
                isinstance(cls, type)
                and issubclass(cls, BaseException)
                and not issubclass(cls, Warning)
                # An exit is not an error: PreemptionExit, a SystemExit with the exit code
                # that no `except Exception` may swallow.
                and not issubclass(cls, SystemExit)
            ):
                found.append(cls)
    return found


def test_the_root_is_public() -> None:
    assert accelkit.AccelkitError is AccelkitError
    assert "AccelkitError" in accelkit.__all__


def test_every_exception_accelkit_defines_has_the_common_root() -> None:
    classes = _exception_classes()
    assert {CheckpointError, StorageError, TrackerError, ConfigurationError} <= set(classes)
    strays = sorted(c.__qualname__ for c in classes if not issubclass(c, AccelkitError))
    assert not strays, f"exceptions outside the AccelkitError family: {strays}"


@pytest.mark.parametrize(
    "cls", [CheckpointError, CorruptCheckpointError, StorageError, TrackerError]
)
def test_failures_are_not_value_errors(cls: type[BaseException]) -> None:
    # A lost process, a failed upload or a damaged file is not a bad argument: a script's
    # `except ValueError` around its own argument handling must not swallow one.
    assert not issubclass(cls, ValueError)


@pytest.mark.parametrize("cls", [ConfigurationError, CheckpointMismatchError, CheckpointPathError])
def test_bad_arguments_stay_value_errors(cls: type[BaseException]) -> None:
    assert issubclass(cls, ValueError) and issubclass(cls, AccelkitError)


def test_storage_and_tracker_failures_keep_their_builtin_kind() -> None:
    assert issubclass(StorageError, OSError)
    assert issubclass(TrackerError, RuntimeError)


def test_a_load_from_nowhere_is_a_value_error_as_in_accelerate(tmp_path: Path) -> None:
    from accelkit import Accelerator

    with pytest.raises(CheckpointPathError, match="does not exist") as info:
        Accelerator(cpu=True).load_state(str(tmp_path / "missing"))
    assert isinstance(info.value, ValueError)


def test_an_unknown_storage_protocol_is_a_configuration_error() -> None:
    from accelkit.checkpointing.storage import get_storage

    with pytest.raises(ConfigurationError, match="nosuchproto"):
        get_storage("nosuchproto://bucket/x")


def test_a_warning_points_at_the_users_line_also_in_a_module_run_with_dash_m(
    tmp_path: Path,
) -> None:
    """``python -m pkg.mod``: the module's loader cannot give ``__main__``'s source; the warning
    must still show the user's line (it raised ImportError inside warn_explicit, killing the
    run, when accelkit handed the module's globals to it)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(
        "from accelkit.errors import warn_at_user_line\n"
        "warn_at_user_line('the fix is here', UserWarning)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-m", "pkg.mod"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert f"{package / 'mod.py'}:2: UserWarning: the fix is here" in done.stderr, done.stderr
    assert "warn_at_user_line('the fix is here'" in done.stderr  # the source line, read by name
