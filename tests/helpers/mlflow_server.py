"""A real ``mlflow server`` on 127.0.0.1 for tests.

One free port, its own process group (a test may kill it with SIGKILL, pause it with SIGSTOP,
or start it again on the same store and port), its output in ``<root>/server.log``, and
nothing that reaches off this machine. Every test that needs a server uses this one class.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.helpers.distributed import free_port

SERVER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    # With a SQL store the server also starts its job runners (seven huey consumers, each
    # importing mlflow), which serve features no test uses: measured here, a start took 42 s
    # and 33 CPU-seconds with them and 14 s and 11 CPU-seconds without.
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    # A file store (``file://``) is refused by default since MLflow 3.
    "MLFLOW_ALLOW_FILE_STORE": "true",
}


class MlflowServer:
    """``mlflow server`` with ``--backend-store-uri store_uri``, run from ``root``.

    ``start()`` returns once ``/health`` answers; ``kill()`` ends the whole process group.
    ``env`` is the server's environment (``os.environ`` by default), with ``SERVER_ENV`` over
    it."""

    def __init__(self, root: Path, store_uri: str, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.store_uri = store_uri
        self.env = {**(os.environ if env is None else env), **SERVER_ENV}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "server.log", "ab") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "mlflow", "server",
                    "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                    "--backend-store-uri", self.store_uri,
                    "--artifacts-destination", (self.root / "artifacts").as_uri(),
                ],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"mlflow server at {self.url} did not answer /health in {timeout:.0f} s:\n"
                    + self.log()
                )
            time.sleep(0.2)

    def signal(self, number: int) -> None:
        """Send ``number`` to the server's process group (SIGSTOP pauses it, SIGCONT resumes)."""
        assert self.process is not None, "the server was never started"
        os.killpg(self.process.pid, number)

    def kill(self) -> None:
        """SIGKILL the server's process group (no-op when it is not running)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log(self) -> str:
        """The end of the server's output."""
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""
