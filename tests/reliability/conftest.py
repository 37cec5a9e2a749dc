"""Fixtures of the reliability tests: the crash-harness zygote, trial counts, the summary.

Every test under ``tests/reliability`` is marked ``reliability``. The default run does a small
sample of each scenario; ``ACCELKIT_RELIABILITY_FULL=1`` runs the full counts (30 SIGKILL trials
per storage, more fuzz examples). ``ACCELKIT_RELIABILITY_SEED`` fixes the seed of the random
kill delays (otherwise one is drawn and printed); ``ACCELKIT_RELIABILITY_SUMMARY=FILE`` writes
the trials run and held by each scenario to ``FILE`` as JSON (the numbers in README.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FULL = os.environ.get("ACCELKIT_RELIABILITY_FULL", "") not in ("", "0")
HARNESS = Path(__file__).with_name("harness.py")
OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "COMET_ERROR_TRACKING_ENABLE": "false",
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DVC_STUDIO_OFFLINE": "true",
    "DO_NOT_TRACK": "1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "CLEARML_OFFLINE_MODE": "1",
}
os.environ.update(OFFLINE_ENV)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``reliability``."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


def trials(default: int, full: int) -> int:
    """The number of trials: ``full`` with ``ACCELKIT_RELIABILITY_FULL=1``, else ``default``."""
    return full if FULL else default


def seed() -> int:
    """The seed of this run's random choices (``ACCELKIT_RELIABILITY_SEED`` or a fresh one)."""
    value = os.environ.get("ACCELKIT_RELIABILITY_SEED")
    return int(value) if value else random.randrange(2**31)


class Zygote:
    """Client of ``harness.py``: one JSON command per line, one JSON answer per line."""

    def __init__(self, workdir: Path) -> None:
        self.log = workdir / "zygote.log"
        self._log_file = open(self.log, "ab")  # noqa: SIM115 - closed in close()
        env = {**os.environ, **OFFLINE_ENV}
        self.process = subprocess.Popen(
            [sys.executable, str(HARNESS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        first = self._read(timeout=180)
        assert "ready" in first, first

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.process.stdout.readline()))
        reader.daemon = True
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            raise RuntimeError(
                f"crash harness did not answer within {timeout} s; its log:\n"
                + self.log.read_text(errors="replace")[-3000:]
            )
        return dict(json.loads(result[0]))

    def call(self, timeout: float = 300, **cmd: Any) -> dict[str, Any]:
        """Send one command and return the answer."""
        with self._lock:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(cmd) + "\n")
            self.process.stdin.flush()
            return self._read(timeout)

    def close(self) -> None:
        """Stop the zygote."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_file.close()


@pytest.fixture(scope="session")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """One crash-harness zygote for the session (torch and accelkit imported once)."""
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    try:
        yield z
    finally:
        z.close()


def wait_for_line(path: Path, prefix: str, timeout: float = 180) -> list[str]:
    """Wait until ``path`` has a line starting with ``prefix``; returns all lines.

    Raises:
        AssertionError: the saver wrote a ``refused`` line (its save failed) instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if any(line.startswith(prefix) for line in lines):
            return lines
        refused = [line for line in lines if line.startswith("refused")]
        assert not refused, f"the saver's save failed while waiting for {prefix!r}: {refused}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no {prefix!r} line after {timeout} s: {lines}")
        time.sleep(0.01)


_SUMMARY: dict[str, Any] = {}


@pytest.fixture(scope="session")
def summary() -> Iterator[dict[str, Any]]:
    """Scenario name -> what it ran and held; written to ``ACCELKIT_RELIABILITY_SUMMARY``."""
    yield _SUMMARY
    target = os.environ.get("ACCELKIT_RELIABILITY_SUMMARY")
    if target and _SUMMARY:
        Path(target).write_text(
            json.dumps({"full": FULL, "scenarios": _SUMMARY}, indent=2, sort_keys=True) + "\n"
        )
