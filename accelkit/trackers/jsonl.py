"""JSON-lines tracker: no dependency, always works offline.

Each ``log()`` appends one line ``{"step": ..., "timestamp": ..., "values": {...}}`` to
``<logging_dir>/<run_name>/metrics.jsonl``; the configuration goes to ``config.json`` beside it.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import IO, Any

from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import to_plain

__all__ = ["JSONLTracker", "read_jsonl"]


class JSONLTracker(GeneralTracker):
    """Append one JSON object per ``log()`` call to ``metrics.jsonl``.

    Values that JSON cannot hold are converted (tensors and arrays to numbers or lists, other
    objects to their text, with one warning per key); NaN and infinities are written as the
    strings ``"nan"``, ``"inf"``, ``"-inf"`` so that every line is strict JSON.

    Args:
        run_name: the sub-folder of ``logging_dir``.
        logging_dir: the run's logging directory.
        flush_every: flush the file every this many lines (``finish`` always flushes).
    """

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(
        self,
        run_name: str = "",
        logging_dir: str | None = None,
        flush_every: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.run_dir = os.path.join(self.logging_dir or ".", run_name)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        self.flush_every = max(1, int(flush_every))
        self._file: IO[str] | None = None
        self._lines = 0

    @property
    @override
    def tracker(self) -> IO[str] | None:
        """The open ``metrics.jsonl`` file."""
        return self._file

    @override
    def start(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        with open(os.path.join(self.run_dir, "config.json"), "w", encoding="utf-8") as file:
            json.dump(_strict(to_plain(values)), file, indent=2)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self._file is None:
            raise RuntimeError("JSONLTracker.log() called before start().")
        converted = {}
        for key, value in values.items():
            if not isinstance(value, (int, float, str, bool, type(None), dict, list)):
                self.warn_skipped(key, value, "written as its converted value or text")
            converted[key] = _strict(to_plain(value))
        record = {"step": step, "timestamp": time.time(), "values": converted}
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._lines += 1
        if self._lines % self.flush_every == 0:
            self._file.flush()

    @override
    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read back a ``metrics.jsonl`` file written by :class:`JSONLTracker`.

    Args:
        path: the file, or the run folder holding it.

    Returns:
        One dict (``step``, ``timestamp``, ``values``) per logged call, in order.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]
