"""JSON-lines tracker: no dependency, always works offline.

Each ``log()`` appends one line ``{"step": ..., "timestamp": ..., "values": {...}}`` to
``<logging_dir>/<run_name>/metrics.jsonl``; the configuration goes to ``config.json`` beside it.
Each checkpoint saved or loaded appends an *event row*, a line with an ``"event"`` key (see
:class:`JSONLTracker`); :func:`read_jsonl` reads the file back, with or without them.

A row is one line holding one JSON object. One parser (``_parse_row``) decides what a row is,
for the tracker's repair at start and for :func:`read_jsonl`: a line that is not UTF-8, not
JSON (cut short by a crash, a number too long to read, nested too deep), not an object, or
longer than 64 MiB is not a row.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import stat
import tempfile
import time
import warnings
from typing import IO, Any, Literal

from typing_extensions import override

from accelkit._text import short
from accelkit.errors import ConfigurationError, UsageError
from accelkit.trackers.backends._files import (
    TrackerFileError,
    check_regular,
    create_exclusive,
    ends_torn,
    make_run_folder,
    open_append,
    open_regular,
    read_lines,
    same_path,
    write_text,
)
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.values import to_plain

__all__ = ["JSONLTracker", "read_jsonl"]

_TEMP_PREFIX = ".metrics.jsonl."
_TEMP_SUFFIX = ".tmp"
_REJECTED = ".rejected-"  # metrics.jsonl.rejected-<time>: the lines a repair moved aside
_MAX_ROW_BYTES = 64 * 2**20  # a longer line is not a row (read in pieces, never whole)
_ROLE = "the jsonl tracker writes its rows"


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
    kept. The rewrite goes to a temporary file in the same folder, synced, then renamed over
    the old file: a crash at any moment leaves either the old file or the new one, whole (a
    leftover temporary file is removed by the next start). It streams the file on the
    tracker's worker thread, parsing every row (about two seconds per 100 MB).

    Damaged files: lines that are not rows (see :func:`read_jsonl`; a last line cut short by a
    crash, a line edited by hand) never stop the tracker. The resume's rewrite, and any start
    that finds the file's last line cut short, moves them to a side file
    ``metrics.jsonl.rejected-<YYYYmmdd-HHMMSS>`` beside it, says so once, and keeps every row
    that parses; a new row never continues a cut-short line. A rewrite that fails (a disk
    error) leaves the file as it was, says so, and the tracker appends to it: the old data
    never costs the new rows.

    Files: ``metrics.jsonl``, ``config.json`` and the run folder are never followed: a link,
    a named pipe, a device or a folder where one of them should be makes :meth:`start` raise
    a ``TrackerFileError`` (an ``OSError``) naming it and the fix; the hub reports it once.

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
        make_run_folder(self.logging_dir or ".", self.run_name, _ROLE)
        _remove_stale_temporaries(self.run_dir)
        keep_until, self._keep_until = self._keep_until, None
        if check_regular(self.path, _ROLE) and (keep_until is not None or _is_torn(self.path)):
            try:
                _rewrite(self.path, keep_until)
            except TrackerFileError:
                raise
            except OSError as error:
                # The old rows could not be rewritten: keep logging the new ones after them.
                stale = ""
                if keep_until is not None:
                    stale = (
                        f"; its rows logged after step {keep_until} by the abandoned attempt stay"
                    )
                warnings.warn(
                    f"Tracker 'jsonl': could not rewrite {self.path} ({type(error).__name__}: "
                    f"{error}); it is left as it was and this job appends to it{stale}.",
                    UserWarning,
                    stacklevel=2,
                )
        self._file = open_append(self.path, _ROLE)

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """The run is this tracker's file, known before it opens: :meth:`run_reference`.

        Args:
            key: the run key (not needed: the folder names the run).
        """
        return self.run_reference()

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"path": <absolute path of metrics.jsonl>}``, for display only."""
        return {"path": os.path.abspath(self.path)}

    @override
    def discard_run(self) -> bool:
        """Nothing to delete: the run is this tracker's ``metrics.jsonl``, which the continued run
        keeps (its next :meth:`start` drops what was logged after the checkpoint)."""
        return True

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
        if reference is not None and not same_path(recorded, self.path):
            warnings.warn(
                f"Tracker 'jsonl': the checkpoint's run wrote to {short(recorded, 200)}, this job "
                f"writes to {os.path.abspath(self.path)!r}; continuing in this job's file "
                "(dropping the rows logged after the checkpoint was saved: those after step "
                f"{step}, the last step logged before it), the other one is left alone.",
                UserWarning,
                stacklevel=2,
            )
        self._keep_until = int(step)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        text = json.dumps(_strict(to_plain(values)), indent=2)
        write_text(os.path.join(self.run_dir, "config.json"), text, "the jsonl tracker writes")

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
        """Append one event row (``"event": "checkpoint_save"``, ``"checkpoint_load"`` or
        ``"checkpoint_replicate"``)."""
        self._write(
            {
                "step": event.step,
                "timestamp": time.time(),
                "event": f"checkpoint_{event.kind}",
                "path": event.path,
                "reason": event.reason,
                **({} if event.tier is None else {"tier": event.tier}),
                "values": {key: _strict(float(value)) for key, value in event.values.items()},
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise UsageError("JSONLTracker.log() called before start().")
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


def _parse_row(line: bytes) -> dict[str, Any] | None:
    """The row on ``line``, or ``None`` if it holds none (see the module docstring)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return record if isinstance(record, dict) else None


def _row_step(record: dict[str, Any]) -> int | None:
    """The row's step, ``None`` without a finite number."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return int(step)


def _is_torn(path: str) -> bool:
    descriptor = open_regular(path, os.O_RDONLY, _ROLE)
    try:
        return ends_torn(descriptor)
    finally:
        os.close(descriptor)


class _SideFile:
    """``metrics.jsonl.rejected-<time>``: created at the first line moved aside."""

    def __init__(self, path: str) -> None:
        self.base = path + _REJECTED + time.strftime("%Y%m%d-%H%M%S")
        self.path: str | None = None
        self.file: IO[bytes] | None = None
        self.lines = 0
        self.torn = False
        self.first: tuple[int, bytes] | None = None

    def write(self, data: bytes) -> None:
        if self.file is None:
            descriptor, self.path = create_exclusive(self.base)
            self.file = open(descriptor, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(data)

    def reject(self, number: int, line: bytes | None, complete: bool) -> None:
        """Count line ``number`` as moved aside (``line``: its bytes, not yet written)."""
        self.lines += 1
        self.torn = self.torn or not complete
        if line is not None:
            self.write(line if complete else line + b"\n")
        elif not complete:
            self.write(b"\n")
        if self.first is None:
            sample = b"(longer than 64 MiB)" if line is None else line[:200].rstrip(b"\r\n")
            self.first = (number, sample)

    def close(self, sync: bool) -> None:
        if self.file is not None:
            if sync:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            self.file = None


def _rewrite(path: str, keep_until: int | None) -> None:
    """Replace ``path`` by a copy holding only its rows, and only those up to ``keep_until``.

    Streams the file (no size limit), writes the kept lines to a temporary file in the same
    folder and the lines that are not rows to a side file, syncs both, renames the copy over
    ``path`` and syncs the folder. On any error the temporary file is removed and ``path`` is
    left as it was.
    """
    folder = os.path.dirname(os.path.abspath(path))
    side = _SideFile(path)
    source_descriptor = open_regular(path, os.O_RDONLY, _ROLE)
    with open(source_descriptor, "rb") as source:
        descriptor, temporary = tempfile.mkstemp(
            prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX, dir=folder
        )
        try:
            with open(descriptor, "wb") as out:
                for number, (line, complete) in enumerate(
                    read_lines(source, _MAX_ROW_BYTES, side.write), start=1
                ):
                    if line is not None and not line.strip():
                        continue
                    record = None if line is None else _parse_row(line)
                    if line is None or record is None:
                        side.reject(number, line, complete)
                        continue
                    step = _row_step(record)
                    if keep_until is None or step is None or step <= keep_until:
                        out.write(line if complete else line + b"\n")
                out.flush()
                os.fsync(out.fileno())
                os.fchmod(out.fileno(), stat.S_IMODE(os.fstat(source.fileno()).st_mode))
            side.close(sync=True)
            os.replace(temporary, path)
        except BaseException:
            side.close(sync=False)
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise
    _sync_folder(folder)
    if side.lines and side.first is not None:
        number, sample = side.first
        torn = " (its last line was cut short, probably by a crash while it was written)"
        warnings.warn(
            f"Tracker 'jsonl': {side.lines} line(s) of {path} are not JSON object rows"
            f"{torn if side.torn else ''}; the first is line {number}: "
            f"{short(sample.decode('utf-8', 'replace'), 100)}. They were moved to "
            f"{side.path or side.base}; the other rows are kept.",
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


def read_jsonl(
    path: str,
    *,
    metrics_only: bool = False,
    errors: Literal["warn", "skip", "raise"] = "warn",
) -> list[dict[str, Any]]:
    """Read back a ``metrics.jsonl`` file written by :class:`JSONLTracker`.

    Args:
        path: the file, or the run folder holding it.
        metrics_only: leave out the checkpoint event rows (those with an ``"event"`` key),
            keeping only what ``log()`` wrote.
        errors: what to do with a line that is not a row (not UTF-8, not JSON, not a JSON
            object, or longer than 64 MiB: a line cut short by a crash, or edited by hand):
            ``"warn"`` skips it and warns once, naming the file, how many lines and the first
            one; ``"skip"`` skips it silently; ``"raise"`` raises a ``ValueError`` naming the
            file and the line. Empty lines are always skipped.

    Returns:
        One dict per row, in order: ``step``, ``timestamp`` and ``values`` for each
        ``log()`` call; event rows also have ``event`` (``"checkpoint_save"`` or
        ``"checkpoint_load"``) and ``path``, their ``values`` the event's numbers.

    Raises:
        ValueError: ``errors="raise"`` and a line is not a row, or ``errors`` is unknown.
        OSError: the file cannot be read, or is not a regular file (a pipe, a device, a
            folder: ``TrackerFileError``).

    Example:
        >>> losses = [r["values"]["loss"] for r in read_jsonl("runs/demo", metrics_only=True)]
    """
    if errors not in ("warn", "skip", "raise"):
        raise ConfigurationError(
            f"read_jsonl(errors={errors!r}): expected 'warn', 'skip' or 'raise'."
        )
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    descriptor = open_regular(path, os.O_RDONLY, "read_jsonl reads rows", follow=True)
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    with open(descriptor, "rb") as file:
        for number, (line, _) in enumerate(read_lines(file, _MAX_ROW_BYTES), start=1):
            if line is not None and not line.strip():
                continue
            record = None if line is None else _parse_row(line)
            if record is not None:
                records.append(record)
                continue
            if errors == "raise":
                shown = (
                    "longer than 64 MiB"
                    if line is None
                    else short(line[:200].rstrip(b"\r\n").decode("utf-8", "replace"), 100)
                )
                raise ConfigurationError(
                    f"{path}, line {number}: not a JSON object row ({shown}). Pass "
                    "errors='warn' or 'skip' to read the other rows; the jsonl tracker moves "
                    "such lines to metrics.jsonl.rejected-<time> when a run resumes."
                )
            bad.append(number)
    if bad and errors == "warn":
        warnings.warn(
            f"read_jsonl: {len(bad)} line(s) of {path} are not JSON object rows and were "
            f"skipped (line {', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''}); "
            "pass errors='raise' to stop at the first, errors='skip' to say nothing.",
            UserWarning,
            stacklevel=2,
        )
    if metrics_only:
        return [record for record in records if "event" not in record]
    return records
