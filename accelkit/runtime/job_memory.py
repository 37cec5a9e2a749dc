"""The job's shared memory: a folder in host memory that outlives a worker process.

``accelkit launch`` creates one folder per job on a memory file system (``/dev/shm``), names it
to its workers in :data:`ENV_MEMORY_DIR`, keeps it across the restarts of
``--max_restarts`` and removes it when the job ends, however it ends (a helper process removes
it when the launcher dies without cleaning up: SIGKILL, the OOM killer). A worker killed mid-run
loses nothing written there; the restarted worker finds it. The memory tier of
``ProjectConfiguration(memory=...)`` keeps its snapshots there (see
:mod:`accelkit.checkpointing.memory`).

Public API: :data:`ENV_MEMORY_DIR`, :func:`job_memory_dir`.
"""

from __future__ import annotations

import os

__all__ = ["ENV_MEMORY_DIR", "job_memory_dir"]

#: Set by ``accelkit launch`` for its workers: the job's folder in shared memory.
ENV_MEMORY_DIR = "ACCELKIT_MEMORY_DIR"


def job_memory_dir() -> str | None:
    """The job's shared-memory folder, or ``None`` outside ``accelkit launch`` (or when it
    is gone: a folder that does not exist is not used)."""
    path = os.environ.get(ENV_MEMORY_DIR, "")
    return path if path and os.path.isdir(path) else None
