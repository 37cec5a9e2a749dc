"""The launcher's side of the job's shared memory (:mod:`accelkit.runtime.job_memory`).

:class:`JobMemory` creates the job's folder on a memory file system, private to this user
(mode ``0700``), and removes it when the job ends. The launcher can die without running its own
cleanup (SIGKILL, the OOM killer), so a small *reaper* process holds the other end of a pipe from
the launcher: when the pipe closes, however the launcher ended, the reaper removes the folder.
Linux kills every worker of a job when its launcher dies (``PR_SET_PDEATHSIG``, see
:mod:`accelkit.launch.signals`), so the reaper removes it once more a moment later, after a
file a dying worker was still writing. The reaper runs in its own session and ignores the
signals meant for the job (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2: a Ctrl-C to the group,
SLURM's signal to every process of the step): it ends when the pipe closes, after cleaning up.

Public API: :class:`JobMemory`, :data:`SHM_ROOT`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from types import TracebackType

__all__ = ["SHM_ROOT", "JobMemory"]

#: Linux's memory file system for shared memory; where it is missing, the temporary folder
#: (on a disk, which a restart still finds, only slower).
SHM_ROOT = "/dev/shm"

# What the reaper runs: wait for the launcher's pipe to close and remove the folder; when the
# launcher did not say goodbye first (it died), again after the workers Linux kills with it are
# surely gone.
_REAPER = (
    "import shutil, signal, sys, time\n"
    # Signals meant for the job (a Ctrl-C to the group, SLURM's to every process of the
    # step) must not end it before it cleaned up: it ends when the launcher's pipe closes.
    "for name in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGUSR1', 'SIGUSR2'):\n"
    "    signal.signal(getattr(signal, name), signal.SIG_IGN)\n"
    "pauses = (0.0,) if sys.stdin.buffer.read() else (0.0, 0.5, 2.0)\n"
    "for pause in pauses:\n"
    "    time.sleep(pause)\n"
    "    shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
)


class JobMemory:
    """The job's shared-memory folder, from ``with JobMemory() as path`` to the job's end.

    Args:
        root: where to create it (default :data:`SHM_ROOT`, else the temporary folder).

    Attributes:
        path: the folder (set on entry).
    """

    def __init__(self, root: str | None = None) -> None:
        self.root = root if root is not None else _default_root()
        self.path = ""
        self._reaper: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="accelkit-job-", dir=self.root)  # mode 0700
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-c", _REAPER, self.path],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        return self.path

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.stdin is not None:
            try:
                reaper.stdin.write(b"done")  # goodbye: the workers are gone, no second pass
                reaper.stdin.close()
                reaper.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):  # pragma: no cover - a stuck reaper
                reaper.kill()


def _default_root() -> str:
    if os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK):
        return SHM_ROOT
    return tempfile.gettempdir()
