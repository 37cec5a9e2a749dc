"""JSON-lines tracker: no dependency, always works offline.

Each ``log()`` appends one line ``{"step": ..., "timestamp": ..., "values": {...}}`` to
``<logging_dir>/<run_name>/metrics.jsonl``; the configuration goes to ``config.json`` beside it.
Each checkpoint saved or loaded appends an *event row*, a line with an ``"event"`` key (see
:class:`JSONLTracker`); :func:`read_jsonl` reads the file back, with or without them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import stat
import tempfile
import time
import warnings
from typing import IO, Any

from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.values import to_plain

__all__ = ["JSONLTracker", "read_jsonl"]

_TEMP_PREFIX = ".metrics.jsonl."
_TEMP_SUFFIX = ".tmp"
# How every row this tracker writes begins: the rewrite reads the step without parsing the row.
_STEP_PREFIX = re.compile(r'\{"step": (-?\d+|null)[,}]')


class JSONLTracker(GeneralTracker):
    """Append one JSON object per ``log()`` call to ``metrics.jsonl``.

    Values that JSON cannot hold are converted (tensors and arrays to numbers or lists, other
    objects to their text, with one warning per key); NaN and infinities are written as the
    strings ``"nan"``, ``"inf"``, ``"-inf"`` so that every line is strict JSON.

    Checkpoints: each save (once committed) and each load appends one event row
    ``{"step", "timestamp", "event": "checkpoint_save" | "checkpoint_load", "path", "values"}``
    at the step the checkpoint belongs to, ``values`` holding the event's numbers
    (``checkpoint/save_seconds``, ... see :mod:`accelkit.trackers.events`). Metric rows never
    have an ``"event"`` key; ``read_jsonl(path, metrics_only=True)`` leaves event rows out.

    Resume: :meth:`run_reference` is ``{"path": <metrics.jsonl>}`` (shown by
    ``accelkit ckpt ls``; never used to choose a file). After :meth:`continue_run`, the next
    :meth:`start` rewrites this tracker's own ``metrics.jsonl`` without the rows whose step is
    after the checkpoint's step (metric and event rows alike: they belong to the timeline the
    resumed job replaces), then appends as usual, so each step appears once. Rows without a
    step (``log()`` called directly without one) cannot be placed on the timeline and are
    kept; a last line cut short by a crash (not JSON) is dropped with a warning. The rewrite
    goes to a temporary file in the same folder, synced, then renamed over the old file: a
    crash at any moment leaves either the old file or the new one, whole (a leftover temporary
    file is removed by the next start). It streams the file on the tracker's worker thread,
    reading each row's step from its beginning (about a second per 100 MB); a rewrite that
    fails leaves the file as it was and fails the tracker's start, reported like any other.

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
        self._keep_until: int | None = None

    @property
    @override
    def tracker(self) -> IO[str] | None:
        """The open ``metrics.jsonl`` file."""
        return self._file

    @override
    def start(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        _remove_stale_temporaries(self.run_dir)
        if self._keep_until is not None:
            if os.path.exists(self.path):
                _rewrite_until(self.path, self._keep_until)
            self._keep_until = None
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"path": <absolute path of metrics.jsonl>}``, for display only."""
        return {"path": os.path.abspath(self.path)}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` drop this file's rows logged after ``step``.

        Only this tracker's own ``metrics.jsonl`` is touched: a reference naming another
        file (a moved project, or a crafted manifest) gets a warning and is not followed.

        Args:
            reference: what :meth:`run_reference` returned in the saving job, or ``None``.
            step: the checkpoint's last logged step (``-1``: drop every row with a step).
        """
        recorded = reference.get("path") if isinstance(reference, dict) else None
        if reference is not None and not _same_file(recorded, self.path):
            warnings.warn(
                f"Tracker 'jsonl': the checkpoint's run wrote to {recorded!r}, this job writes "
                f"to {os.path.abspath(self.path)!r}; continuing in this job's file (dropping "
                f"its rows after step {step}), the other one is left alone.",
                UserWarning,
                stacklevel=2,
            )
        self._keep_until = int(step)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        with open(os.path.join(self.run_dir, "config.json"), "w", encoding="utf-8") as file:
            json.dump(_strict(to_plain(values)), file, indent=2)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        converted = {}
        for key, value in values.items():
            if not isinstance(value, (int, float, str, bool, type(None), dict, list)):
                self.warn_skipped(key, value, "written as its converted value or text")
            converted[key] = _strict(to_plain(value))
        self._write({"step": step, "timestamp": time.time(), "values": converted})

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Append one event row (``"event": "checkpoint_save"`` or ``"checkpoint_load"``)."""
        self._write(
            {
                "step": event.step,
                "timestamp": time.time(),
                "event": f"checkpoint_{event.kind}",
                "path": event.path,
                "values": {key: _strict(float(value)) for key, value in event.values.items()},
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError("JSONLTracker.log() called before start().")
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


def _same_file(recorded: Any, path: str) -> bool:
    if not isinstance(recorded, str):
        return False
    return os.path.normcase(os.path.realpath(recorded)) == os.path.normcase(os.path.realpath(path))


def _row_step(line: str) -> tuple[bool, int | None]:
    """Whether ``line`` is a JSON object, and its step (``None`` without a finite number)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False, None
    if not isinstance(record, dict):
        return False, None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return True, None
    return True, int(step)


def _rewrite_until(path: str, step: int) -> None:
    """Replace ``path`` by a copy without the rows whose step is after ``step``, atomically.

    Streams the file (no size limit), writes the kept lines to a temporary file in the same
    folder, syncs it, renames it over ``path`` and syncs the folder. On any error the
    temporary file is removed and ``path`` is left as it was.
    """
    folder = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX, dir=folder)
    torn = 0
    try:
        with (
            open(descriptor, "w", encoding="utf-8", errors="surrogateescape") as out,
            open(path, encoding="utf-8", errors="surrogateescape") as source,
        ):
            for line in source:
                text = line.rstrip("\n")
                if not text.strip():
                    continue
                match = _STEP_PREFIX.match(text)
                if match and line.endswith("\n"):
                    row_step = None if match[1] == "null" else int(match[1])
                else:
                    is_json, row_step = _row_step(text)
                    if not is_json and not line.endswith("\n"):
                        torn += 1  # the last line, cut short by a crash
                        continue
                if row_step is None or row_step <= step:
                    out.write(text + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _sync_folder(folder)
    if torn:
        warnings.warn(
            f"Tracker 'jsonl': the last line of {path} was cut short (not JSON, probably a "
            "crash while it was written); it was dropped when the run resumed.",
            UserWarning,
            stacklevel=3,
        )


def _sync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (where the platform can open a folder)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _remove_stale_temporaries(folder: str) -> None:
    """Remove the temporary files of a rewrite a crash interrupted (never the real file)."""
    for leftover in glob.glob(os.path.join(glob.escape(folder), _TEMP_PREFIX + "*" + _TEMP_SUFFIX)):
        with contextlib.suppress(OSError):
            os.remove(leftover)


def read_jsonl(path: str, *, metrics_only: bool = False) -> list[dict[str, Any]]:
    """Read back a ``metrics.jsonl`` file written by :class:`JSONLTracker`.

    Args:
        path: the file, or the run folder holding it.
        metrics_only: leave out the checkpoint event rows (those with an ``"event"`` key),
            keeping only what ``log()`` wrote.

    Returns:
        One dict per line, in order: ``step``, ``timestamp`` and ``values`` for each
        ``log()`` call; event rows also have ``event`` (``"checkpoint_save"`` or
        ``"checkpoint_load"``) and ``path``, their ``values`` the event's numbers.

    Example:
        >>> losses = [r["values"]["loss"] for r in read_jsonl("runs/demo", metrics_only=True)]
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path, encoding="utf-8") as file:
        records = [json.loads(line) for line in file if line.strip()]
    if metrics_only:
        return [record for record in records if "event" not in record]
    return records
