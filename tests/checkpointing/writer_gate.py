"""Holding back and failing the background writer of an asynchronous save, for both writers.

The thread writer writes through ``gatedfile://`` (:mod:`tests.checkpointing.gatedfs`): its
writes wait at a gate, or fail on a chosen file. The process writer writes the local disk
from another process, so the same states are made with real process controls instead:

- *held*: the writer process is stopped (``SIGSTOP``) before the save, so the job waits in
  its socket; ``SIGCONT`` lets it go on;
- *failing*: the writer process's file-size limit is set to 0 (``prlimit RLIMIT_FSIZE``;
  it ignores ``SIGXFSZ``), so every file it writes fails with ``EFBIG`` ("File too large").

Use one :class:`WriterGate` per test (or per process of a distributed job).
"""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

from tests.checkpointing.gatedfs import GatedFileSystem, gated_url

__all__ = ["WRITERS", "WriterGate"]

WRITERS = ("thread", "process")


class WriterGate:
    """The gate of one writer mode (``"thread"`` or ``"process"``)."""

    def __init__(self, mode: str) -> None:
        assert mode in WRITERS, mode
        self.mode = mode
        self._pid: int | None = None
        self._stopped = False

    @property
    def failure_text(self) -> str:
        """What the injected failure says."""
        return "injected write failure" if self.mode == "thread" else "File too large"

    def url(self, path: str | Path) -> str:
        """The project folder to use: gated for the thread, the plain local path otherwise."""
        return gated_url(path) if self.mode == "thread" else str(path)

    def config(self) -> dict[str, Any]:
        """The ``ProjectConfiguration`` fields of this mode."""
        return {"async_writer": self.mode}

    def attach(self, acc: Any) -> None:
        """Start ``acc``'s writer process now (the process mode), so it can be held before the
        first save."""
        if self.mode != "process":
            return
        from accelkit.checkpointing.commit.writer_process import shared_writer

        saver = acc._checkpoints.background
        if saver.process is None:
            saver.process = shared_writer()
        saver.process.ensure()
        self._pid = saver.process.pid

    def _writer_pid(self, acc: Any) -> int:
        process = acc._checkpoints.background.process
        if process is None or not process.alive():
            self.attach(acc)
            process = acc._checkpoints.background.process
        assert process is not None and process.pid is not None
        self._pid = process.pid
        return process.pid

    def hold(self, acc: Any) -> None:
        """Hold back the writes of the next saves."""
        if self.mode == "thread":
            GatedFileSystem.gate.clear()
        else:
            os.kill(self._writer_pid(acc), signal.SIGSTOP)
            self._stopped = True

    def waiting(self) -> bool:
        """Whether a save is held (the thread: its first write reached the gate)."""
        if self.mode == "thread":
            return GatedFileSystem.writes_waiting.wait(30)
        time.sleep(0.2)  # the job sits in the stopped writer's socket
        return self._stopped

    def release(self) -> None:
        """Let held writes go on."""
        if self.mode == "thread":
            GatedFileSystem.gate.set()
        elif self._pid is not None and self._stopped:
            os.kill(self._pid, signal.SIGCONT)
            self._stopped = False

    def fail(self, acc: Any, on: str | None) -> None:
        """Make the next writes fail (the thread: files whose path contains ``on``; the
        process: every file its writer writes), or, with ``None``, succeed again."""
        if self.mode == "thread":
            GatedFileSystem.fail_on = on
            return
        pid = self._writer_pid(acc)
        _soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (0 if on else hard, hard))

    def reset(self) -> None:
        """Undo everything (test teardown)."""
        self.release()
