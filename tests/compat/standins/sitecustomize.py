"""Harness for the example runs (not a stand-in): tag each stdout line with the process's rank.

With ``ACCELKIT_EXAMPLES_TAG_RANKS`` set to the folder of the example scripts (by
``tests/compat/examples_matrix.py``), every line a script's process prints to stdout goes out
whole, in one ``write`` to the pipe, as ``[rank N] line``, so the lines of two processes can
be told apart and never merge mid-line (the examples print some lines on every rank). The
scripts themselves are not touched.
"""

from __future__ import annotations

import atexit
import os
import sys


class _RankLines:
    def __init__(self, stream, rank: str) -> None:  # type: ignore[no-untyped-def]
        self._stream = stream
        self._fd = stream.fileno()
        self._prefix = f"[rank {rank}] ".encode()
        self._pending = ""

    def write(self, text: str) -> int:
        # Only a script's own lines: the launchers' processes (whose argv[0] is no example
        # script) write through unchanged.
        if not os.path.abspath(sys.argv[0] if sys.argv else "").startswith(_ROOT):
            return int(self._stream.write(text))
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            os.write(self._fd, self._prefix + line.encode() + b"\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def close_pending(self) -> None:
        if self._pending:
            self.write("\n")

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._stream, name)


_ROOT = os.environ.get("ACCELKIT_EXAMPLES_TAG_RANKS", "")
if _ROOT and not isinstance(sys.stdout, _RankLines):
    sys.stdout.flush()
    sys.stdout = _RankLines(sys.stdout, os.environ.get("RANK", "0"))  # type: ignore[assignment]
    atexit.register(sys.stdout.close_pending)  # type: ignore[attr-defined]
