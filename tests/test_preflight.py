"""Misconfigured folders and storage fail at ``Accelerator(...)``, not an epoch later.

Every case uses the real thing: a path under a regular file, a real read-only file system (a
tmpfs mounted read-only in a private mount namespace: the tests run as root, and root writes
through permission bits, so ``chmod`` alone proves nothing), ``s3fs`` made unimportable in a
fresh interpreter, a real S3 server with wrong credentials, and two real processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, ProjectConfiguration
from accelkit._accelerator.preflight import ConfigurationError
from accelkit.trackers.backends.jsonl import read_jsonl
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def test_logging_dir_under_a_file_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    logs = blocker / "runs" / "logs"
    with pytest.raises(ConfigurationError) as info:
        Accelerator(log_with="jsonl", project_dir=str(logs))
    message = str(info.value)
    assert repr(str(logs)) in message and repr(str(blocker)) in message
    assert "is a file" in message and "logging_dir=" in message


def test_project_dir_that_is_a_file_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "project.txt"
    blocker.write_text("")
    # Without trackers: only checked, nothing created.
    with pytest.raises(ConfigurationError, match=r"project\.txt' is a file, not a folder"):
        Accelerator(project_dir=str(blocker))
    with pytest.raises(ConfigurationError, match=r"cannot be created: '.*project\.txt' is a file"):
        Accelerator(project_dir=str(blocker / "sub"))
    # With a tracker the logging directory (the project_dir by default) is what fails.
    with pytest.raises(ConfigurationError, match=r"logging directory '.*project\.txt'.*a file"):
        Accelerator(log_with="jsonl", project_dir=str(blocker))
    # A separate logging_dir is fine, but the checkpoint folder is still a file.
    config = ProjectConfiguration(project_dir=str(blocker), logging_dir=str(tmp_path / "logs"))
    with pytest.raises(ConfigurationError, match=r"project_dir '.*project\.txt' is a file"):
        Accelerator(log_with="jsonl", project_config=config)


def test_a_good_configuration_creates_only_the_logging_dir(tmp_path: Path) -> None:
    project = tmp_path / "project"
    Accelerator(project_dir=str(project))
    assert not project.exists()  # no tracker: nothing to create yet
    accelerator = Accelerator(log_with="jsonl", project_dir=str(project))
    assert sorted(project.iterdir()) == []  # created, and the probe file is gone
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=0)
    accelerator.end_training()
    assert read_jsonl(str(project / "run"))[0]["values"] == {"x": 1}


# A read-only file system in a private mount namespace: it disappears with the process.
READ_ONLY_SCRIPT = """
import sys
from accelkit import Accelerator, ProjectConfiguration
from accelkit._accelerator.preflight import ConfigurationError

MOUNT = sys.argv[1]
cases = {
    "logs_in_ro": dict(log_with="jsonl", project_dir=MOUNT + "/logs"),
    "logs_are_ro": dict(log_with="jsonl", project_dir=MOUNT),
    "project_in_ro": dict(project_dir=MOUNT + "/project"),
}
for name, kwargs in cases.items():
    try:
        Accelerator(**kwargs)
        print(name, "NO ERROR")
    except ConfigurationError as error:
        print(name, "|", error)
"""


def _read_only_mount_command(mount: Path) -> list[str] | None:
    """A command prefix running in a new mount namespace with ``mount`` a read-only tmpfs."""
    if shutil.which("unshare") is None:
        return None
    setup = f'mount -t tmpfs -o ro tmpfs {mount} && exec "$@"'
    for unshare in (
        ["unshare", "--mount", "--propagation", "private"],
        ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"],
    ):
        probe = subprocess.run(
            [*unshare, "sh", "-c", setup, "sh", "true"], capture_output=True, timeout=30
        )
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", setup, "sh"]
    return None


@pytest.mark.slow
def test_read_only_file_system_fails_at_construction(tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    prefix = _read_only_mount_command(mount)
    if prefix is None:
        pytest.skip(
            "cannot mount a read-only tmpfs here (no `unshare --mount`, nor a user namespace); "
            "as root, chmod does not make a folder read-only, so there is no other honest test"
        )
    result = subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(READ_ONLY_SCRIPT), str(mount)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines.keys() >= {"logs_in_ro", "logs_are_ro", "project_in_ro"}, result.stdout
    assert f"'{mount}/logs' cannot be used: it is on a read-only file system" in lines["logs_in_ro"]
    assert f"'{mount}' cannot be used: it is on a read-only file system" in lines["logs_are_ro"]
    assert "logging_dir=" in lines["logs_are_ro"]
    assert (
        f"'{mount}/project' cannot be created in '{mount}' (read-only file system)"
        in lines["project_in_ro"]
    )
    assert "project_dir=" in lines["project_in_ro"]


@pytest.mark.slow
def test_s3_project_dir_without_s3fs_fails_at_construction(tmp_path: Path) -> None:
    # A fresh interpreter where `import s3fs` fails, as if the package were not installed.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["s3fs"] = None
        from accelkit import Accelerator
        from accelkit._accelerator.preflight import ConfigurationError
        try:
            Accelerator(project_dir="s3://bucket/run-7")
        except ConfigurationError as error:
            print("ERROR", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ERROR project_dir 's3://bucket/run-7' cannot be used" in result.stdout
    assert "pip install 'accelkit[s3]'" in result.stdout


def test_unreachable_storage_fails_at_construction(s3_server: Any, s3_url: str) -> None:
    wrong = {**s3_server.storage_options, "secret": "not-the-secret"}
    config = ProjectConfiguration(project_dir=s3_url, storage_options=wrong)
    with pytest.raises(ConfigurationError, match=r"cannot be reached.*storage_options") as info:
        Accelerator(project_config=config)
    assert repr(s3_url) in str(info.value)
    right = ProjectConfiguration(project_dir=s3_url, storage_options=s3_server.storage_options)
    Accelerator(project_config=right)


def _job(project_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    try:
        Accelerator(log_with="jsonl", project_dir=project_dir)
        outcome = "constructed"
    except ConfigurationError as error:
        outcome = str(error)
    # Both processes are still in step: a collective after the failure completes.
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, outcome)
    return {"rank": dist.get_rank(), "outcome": outcome, "gathered": gathered}


@pytest.mark.slow
def test_processes_agree_and_none_hangs(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    main, other = run_distributed(_job, str(blocker / "logs"), world_size=2, timeout=180)
    assert "is a file" in main["outcome"] and str(blocker) in main["outcome"]
    assert other["outcome"] == main["outcome"]  # the same error on every process
    assert main["gathered"] == [main["outcome"]] * 2
