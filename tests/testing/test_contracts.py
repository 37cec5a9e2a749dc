"""The shipped contract suites (:mod:`accelkit.testing`) as a third party uses them: run by
pytest on a backend defined outside accelkit's tests, they pass a good one and fail, test by
test, a broken one. Importing accelkit does not import pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

THIRD_PARTY_TESTS = r'''
import csv, json, os

import pytest

from accelkit.checkpointing.storage import get_storage
from accelkit.checkpointing.storage.local import LocalStorage
from accelkit.testing import StorageContract, TrackerContract
from accelkit.trackers import GeneralTracker


class ForgetfulStorage(LocalStorage):
    """Two classic bugs: an exclusive create that is not exclusive, an rmtree that is a no-op."""

    def create_exclusive(self, url, data):
        self.write_bytes(url, data)
        return True

    def rmtree(self, url):
        pass


class TestGoodStorage(StorageContract):
    @pytest.fixture
    def storage_root(self, tmp_path):
        return get_storage(str(tmp_path)), str(tmp_path / "root")


class TestForgetfulStorage(StorageContract):
    @pytest.fixture
    def storage_root(self, tmp_path):
        return ForgetfulStorage(), str(tmp_path / "root")


class RowTracker(GeneralTracker):
    """Writes ``step,key,value`` rows; ``relative`` makes it write into the working dir."""

    name = "rows"
    requires_logging_directory = True
    relative = False

    def __init__(self, run_name="", logging_dir=None, **kwargs):
        super().__init__(run_name, logging_dir, **kwargs)
        base = "." if self.relative else logging_dir
        self.path = os.path.join(base, run_name, "rows.csv")

    @property
    def tracker(self):
        return self.path

    def start(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def store_init_configuration(self, values):
        from accelkit.trackers.values import flatten

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(os.path.join(os.path.dirname(self.path), "config.json"), "w") as f:
            json.dump({k: str(v) for k, v in flatten(values).items()}, f)

    def log(self, values, step=None, **kwargs):
        with open(self.path, "a") as f:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    f.write(f"{step},{key},{float(value)!r}\n")


class LeakyTracker(RowTracker):
    name = "leaky_rows"
    relative = True


def read_rows(folder, run):
    scalars = {}
    with open(os.path.join(folder, run, "rows.csv")) as f:
        for step, key, value in csv.reader(f):
            scalars.setdefault(key, []).append((int(step), float(value)))
    with open(os.path.join(folder, run, "config.json")) as f:
        return scalars, json.load(f)


class TestGoodTracker(TrackerContract):
    log_with, files, register = "rows", "conformance/rows.csv", RowTracker

    def read_back(self, logging_dir, run):
        return read_rows(logging_dir, run)


class TestLeakyTracker(TrackerContract):
    log_with, files, register = "leaky_rows", "conformance/rows.csv", LeakyTracker

    def read_back(self, logging_dir, run):
        return read_rows(logging_dir, run)
'''


def test_contracts_pass_a_good_backend_and_fail_a_broken_one(tmp_path: Path) -> None:
    (tmp_path / "test_third_party.py").write_text(textwrap.dedent(THIRD_PARTY_TESTS))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-W", "ignore"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    failed = sorted(
        line.split()[1].split("::", 1)[1]
        for line in done.stdout.splitlines()
        if line.startswith("FAILED ")
    )
    assert failed == [
        "TestForgetfulStorage::test_create_exclusive_creates_once",
        "TestForgetfulStorage::test_remove_and_rmtree",
        "TestLeakyTracker::test_recovery_contract",
        "TestLeakyTracker::test_tracker_contract",
    ], done.stdout + done.stderr
    assert "leaky_rows wrote no conformance/rows.csv" in done.stdout, done.stdout
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("4 failed, 22 passed"), done.stdout  # 2 checkpoint contracts pass


def test_importing_accelkit_does_not_import_pytest() -> None:
    code = (
        "import sys, accelkit, accelkit.testing, accelkit.checkpointing.storage\n"
        "print(sorted(m for m in ('pytest', 'fsspec') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
