"""The tracker journal: every value a tracker accepts, on local disk before the backend sees it.

A tracker is somebody else's network service; its outage must not cost the run its curves. With
a logging directory, each tracker's worker thread (never the training thread) appends what it
is about to send (``log`` values with their step and wall time, the stored configuration,
checkpoint events) to ``<logging_dir>/accelkit-journal/<tracker>/``, one batch per write, and
records the sequence number of the last entry the backend accepted in ``acked``. A backend that
fails is retried with backoff and caught up from ``acked + 1``; ``accelkit track sync`` sends
later what a run could not.

On disk (all plain text, written by :class:`Journal` only):

=================== ==========================================================================
``run.json``        the tracker's name, the project name, its constructor's keyword arguments
                    (those JSON can hold) and its run reference (``run_reference()``)
``<seq>.jsonl``     segments of entries, one JSON object per line: ``seq``, ``kind``
                    (``log``, ``config``, ``event``), ``step``, ``time`` (wall time) and
                    ``values`` (plus ``kwargs`` and the event's fields where there are some);
                    a segment is named after its first entry's ``seq``
``acked``           two lines: the ``seq`` of the last entry the backend accepted, and of the
                    last entry being sent (one entry, or the end of a ``log_batch`` call's);
                    rewritten in place (through a shared memory map of the file, else one
                    ``pwrite``) just before a backend call and right after it returns
=================== ==========================================================================

Every file of a journal is untrusted input when it is read back (a resumed job, ``track sync``):
opened without following links nor blocking on pipes
(:mod:`accelkit.trackers.backends._files`), read in bounded pieces (a line longer than 16 MiB
is never held whole), each line parsed alone; a line that is not an entry (or longer than
that) is reported with its file and line number and skipped, a link, a pipe or a device is
reported and left alone. None of this ever raises into
training: a journal that cannot be used is reported once and the tracker goes on without it.

Disk use is bounded by ``max_bytes`` (default ``ACCELKIT_TRACKER_JOURNAL_MAX_MB`` or 1024 MB
per tracker): delivered segments are removed first; when undelivered ones alone pass the cap,
the oldest are removed (the newest are kept) and that is said once.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from accelkit._env import number
from accelkit._text import short
from accelkit.trackers.backends._files import (
    TrackerFileError,
    check_regular,
    make_run_folder,
    open_regular,
    read_lines,
)
from accelkit.trackers.values import PLAIN_TYPES, to_plain

__all__ = [
    "JOURNAL_FOLDER",
    "Entry",
    "Journal",
    "JournalStatus",
    "JournalWarning",
    "default_max_bytes",
    "journal_folders",
]

JOURNAL_FOLDER = "accelkit-journal"
"""The folder under the logging directory that holds one journal per tracker."""

_SEGMENT = re.compile(r"^(\d{12})\.jsonl$")
# How :func:`_line` begins every entry (``seq`` first, no spaces): read alone when a journal opens.
# (At most 12 digits, as segment names have: a longer seq goes through the full parse.)
_SEQ_PREFIX = re.compile(rb'\{"seq":(0|[1-9]\d{0,11}),"kind":"(?:log|config|event)",')
_MAX_LINE = 16 * 2**20  # a longer line is not an entry (values are numbers and short text)
_ROLE = "the tracker journal keeps the values not yet delivered"


def _refuse(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON data")


# One C encoder for every line, made once: ``json.dumps`` with any non-default argument builds
# a new encoder per call (most of a line's cost, on the tracker's thread, holding the GIL). No
# circular-reference check: entry values are plain data (``to_plain`` output), never cyclic.
_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)
if _C_ENCODER is not None:
    _ITERENCODE = _C_ENCODER(
        None, _refuse, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )

    def _encode(record: dict[str, Any]) -> str:
        return "".join(_ITERENCODE(record, 0))

else:  # an interpreter without the C accelerator
    _PY_ENCODE = json.JSONEncoder(separators=(",", ":")).encode

    def _encode(record: dict[str, Any]) -> str:
        return _PY_ENCODE(record)


_ACK_SIZE = 42  # two lines of 20 digits: `acked` and the entry (or batch end) being sent


class JournalWarning(UserWarning):
    """A journal file could not be used as it is (damaged, a link, a pipe) or its cap was hit."""


class Entry(NamedTuple):
    """One journaled request to a tracker (a named tuple: the worker makes one per logged
    value set, and a tuple costs a fraction of a frozen dataclass).

    Attributes:
        seq: its number in the journal (0, 1, ...; never reused).
        kind: ``"log"``, ``"config"`` or ``"event"``.
        step: the logging step (``-1`` for a configuration).
        time: wall time (seconds since the epoch) when it was journaled.
        values: the values (plain JSON data).
        extra: ``kwargs`` for ``log``; the event's ``kind``, ``path`` and ``iteration``.
    """

    seq: int
    kind: str
    step: int
    time: float
    values: Mapping[str, Any]
    extra: Mapping[str, Any]


@dataclass(frozen=True)
class JournalStatus:
    """What a journal holds: entries journaled, delivered and pending.

    Attributes:
        name: the tracker's folder name.
        folder: the journal's folder.
        journaled: entries written since the journal began (the next ``seq``).
        delivered: entries the backend accepted (``acked + 1``).
        pending: entries on disk not delivered yet.
        reference: the run reference recorded in ``run.json`` (``None``: none).
        problems: what could not be read, one line each.
    """

    name: str
    folder: str
    journaled: int
    delivered: int
    pending: int
    reference: Mapping[str, Any] | None
    problems: tuple[str, ...]


def default_max_bytes() -> int:
    """The per-tracker cap: ``ACCELKIT_TRACKER_JOURNAL_MAX_MB`` (default 1024) megabytes."""
    return int(number("ACCELKIT_TRACKER_JOURNAL_MAX_MB") * 2**20)


def journal_folders(logging_dir: str) -> list[str]:
    """The journal folders under ``logging_dir`` (links and non-folders left out), sorted."""
    root = os.path.join(logging_dir, JOURNAL_FOLDER)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    folders = []
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                folders.append(path)
        except OSError:
            continue
    return folders


def _plain_values(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``values`` as JSON data: the mapping itself when it holds only plain values under text
    keys (the usual numbers: no copy), else a converted copy."""
    plain = PLAIN_TYPES
    for key, value in values.items():
        if type(value) not in plain or type(key) is not str:
            return {str(key): to_plain(value) for key, value in values.items()}
    return values


class Journal:
    """One tracker's journal (see the module docstring); used by one thread at a time.

    Args:
        folder: the journal's folder (``<logging_dir>/accelkit-journal/<name>``).
        max_bytes: the disk cap (default :func:`default_max_bytes`).
        segment_bytes: how large a segment grows before the next one begins.

    Attributes:
        next_seq: the ``seq`` the next entry gets.
        acked: the ``seq`` of the last delivered entry (``-1``: none).
        in_doubt: ``None``, or the last ``seq`` of the entries a killed sender was sending
            (those after ``acked`` up to it): the backend may hold some of them (in order), so
            the next sender asks it before sending them again
            (:func:`accelkit.trackers.delivery.send.settle`).
        problems: what was reported when the journal was read.
    """

    def __init__(
        self, folder: str, *, max_bytes: int | None = None, segment_bytes: int | None = None
    ) -> None:
        self.folder = folder
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        self.segment_bytes = segment_bytes or max(4096, min(64 * 2**20, self.max_bytes // 8))
        self.next_seq = 0
        self.acked = -1
        self.problems: list[str] = []
        self._segments: list[tuple[int, str, int]] = []  # (first seq, path, size)
        self._fd: int | None = None
        self._ack = AckRecord(os.path.join(folder, "acked"))
        self._cap_said = False
        self.dropped = 0
        self.in_doubt: int | None = None

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, logging_dir: str, name: str, **kwargs: Any) -> Journal:
        """Open (or create) the journal of tracker ``name`` under ``logging_dir``.

        Raises:
            TrackerFileError: the journal's folder or one of its files is a link, a pipe, a
                device; the caller reports it and goes on without a journal.
        """
        folder = make_run_folder(logging_dir, f"{JOURNAL_FOLDER}/{name}", _ROLE)
        journal = cls(folder, **kwargs)
        journal.load()
        return journal

    def load(self) -> None:
        """Read what is on disk: the segments (to find ``next_seq``) and ``acked``."""
        segments = []
        for name in sorted(os.listdir(self.folder)):
            match = _SEGMENT.match(name)
            if match is None:
                continue
            path = os.path.join(self.folder, name)
            try:
                if not check_regular(path, _ROLE):
                    continue
            except TrackerFileError as error:
                self._problem(short(str(error), 300))
                continue
            segments.append((int(match.group(1)), path, os.lstat(path).st_size))
        self._segments = segments
        last = -1
        if segments:
            last = max(self._last_seq(segments[-1][1]), segments[-1][0] - 1)
        self.next_seq = last + 1
        acked, sending = self._ack.read(self._problem)
        if sending is not None and sending > acked:
            self.in_doubt = sending
        self.acked = min(acked, last)
        if self.in_doubt is not None:
            self.in_doubt = min(self.in_doubt, last) if self.in_doubt > self.acked else None

    def _problem(self, what: str) -> None:
        self.problems.append(what)
        warnings.warn(f"Tracker journal: {what}.", JournalWarning, stacklevel=2)

    # ------------------------------------------------------------------ writing

    def write_run(self, info: Mapping[str, Any]) -> None:
        """Record the run (name, project, constructor arguments, reference) in ``run.json``."""
        text = json.dumps(to_plain(dict(info)), sort_keys=True)
        path = os.path.join(self.folder, "run.json")
        temporary = path + ".tmp"
        check_regular(temporary, _ROLE)
        descriptor = open_regular(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _ROLE)
        try:
            os.write(descriptor, text.encode())
        finally:
            os.close(descriptor)
        os.replace(temporary, path)  # replaces a link at run.json, never follows it

    def read_run(self) -> dict[str, Any] | None:
        """What ``run.json`` holds, or ``None`` (missing or damaged: reported)."""
        path = os.path.join(self.folder, "run.json")
        try:
            if not check_regular(path, _ROLE):
                return None
            descriptor = open_regular(path, os.O_RDONLY, _ROLE)
            with open(descriptor, "rb") as file:
                data = file.read(_MAX_LINE)
            run = json.loads(data)
        except (TrackerFileError, OSError, ValueError) as error:
            self._problem(f"{path}: {short(str(error), 200)}")
            return None
        if not isinstance(run, dict):
            self._problem(f"{path}: not a JSON object")
            return None
        return run

    def write(self, entries: list[Entry]) -> None:
        """Write ``entries`` (made by :meth:`entry`), one ``write`` per segment they fill; rolls
        segments and keeps the cap.

        A batch larger than a segment (a backlog drained at once) is split where the segment
        fills up, so that the cap can remove its oldest part too.
        """
        if not entries:
            return
        lines = [_line(entry).encode() for entry in entries]
        start = 0
        while start < len(lines):
            if self._fd is None or (self._segments and self._segments[-1][2] >= self.segment_bytes):
                self._roll(entries[start].seq)
            room = self.segment_bytes - self._segments[-1][2]
            end, size = start, 0
            while end < len(lines) and (end == start or size + len(lines[end]) <= room):
                size += len(lines[end])
                end += 1
            assert self._fd is not None
            os.write(self._fd, b"".join(lines[start:end]))
            first, path, written = self._segments[-1]
            self._segments[-1] = (first, path, written + size)
            start = end
            if sum(segment[2] for segment in self._segments) > self.max_bytes:
                self._keep_cap()

    def entry(
        self,
        kind: str,
        step: int,
        values: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
    ) -> Entry:
        """A new entry with the next ``seq`` (not written yet: pass it to :meth:`write`)."""
        entry = Entry(self.next_seq, kind, step, time.time(), _plain_values(values), extra or {})
        self.next_seq += 1
        return entry

    def _roll(self, first_seq: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        path = os.path.join(self.folder, f"{first_seq:012d}.jsonl")
        self._fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _ROLE)
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")  # a torn last line (a crash) never continues into ours
            size += 1
        if self._segments and self._segments[-1][1] == path:
            self._segments[-1] = (first_seq, path, size)
        else:
            self._segments.append((first_seq, path, size))

    def _keep_cap(self) -> None:
        """Remove the oldest segments until the journal fits its cap (never the one being
        written); say it once when undelivered entries go."""
        while len(self._segments) > 1 and sum(s[2] for s in self._segments) > self.max_bytes:
            first, path, _ = self._segments.pop(0)
            next_first = self._segments[0][0]
            if next_first - 1 > self.acked:
                lost = next_first - max(first, self.acked + 1)
                self.dropped += lost
                if not self._cap_said:
                    self._cap_said = True
                    warnings.warn(
                        f"Tracker journal {self.folder} reached its cap of "
                        f"{self.max_bytes / 2**20:g} MB while its backend was not accepting "
                        f"values: the oldest undelivered entries (from seq {first}) are removed "
                        "and the newest kept. Raise TrackerOptions(journal_max_mb=...) or "
                        "ACCELKIT_TRACKER_JOURNAL_MAX_MB to keep more.",
                        JournalWarning,
                        stacklevel=2,
                    )
                self.ack(next_first - 1, sync=False)
            try:
                os.unlink(path)
            except OSError:
                pass

    def sending(self, seq: int) -> None:
        """Record that the entries after ``acked`` up to ``seq`` are being sent (one entry,
        or a batch handed to ``log_batch``): a process killed before its :meth:`ack` leaves
        them *in doubt* (the backend may have taken them), which the next sender settles (see
        :attr:`in_doubt`)."""
        self._ack.mark(self.acked, seq)

    def ack(self, seq: int, *, sync: bool = False) -> None:
        """Record that the backend accepted every entry up to ``seq``."""
        if seq <= self.acked:
            return
        self.acked = seq
        self.in_doubt = None
        self._ack.mark(seq, seq)
        if sync:
            self.sync()

    def sync(self) -> None:
        """Flush the open segment and ``acked`` to the disk (``fsync``)."""
        self._ack.sync()
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """Sync and close the files."""
        self._ack.close()
        _close_synced(self._fd)
        self._fd = None

    # ------------------------------------------------------------------ reading

    def pending(self, limit: int | None = None) -> list[Entry]:
        """Entries after ``acked`` in order, read from disk (at most ``limit``)."""
        out: list[Entry] = []
        for first, path, _ in list(self._segments):
            following = [s[0] for s in self._segments if s[0] > first]
            if following and following[0] - 1 <= self.acked:
                continue  # every entry of this segment was delivered
            for entry in self._read_segment(path):
                if entry.seq > self.acked and entry.seq < self.next_seq:
                    out.append(entry)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def last_step(self) -> int:
        """The largest step in the newest segment (``-1``: none): where the run stopped."""
        if not self._segments:
            return -1
        return max((entry.step for entry in self._read_segment(self._segments[-1][1])), default=-1)

    def _last_seq(self, path: str) -> int:
        """The ``seq`` of the last entry of the segment at ``path`` (``-1``: none), by the rules
        of :meth:`_read_segment`. A line as :func:`_line` writes it is read up to its ``seq``
        only: opening a journal does not parse every value (they are parsed when sent)."""
        last = -1
        for line_no, line in self._lines(path):
            match = _SEQ_PREFIX.match(line)
            if match is not None:
                seq: int | None = int(match.group(1))
            else:
                entry = _parse(line)
                seq = None if entry is None else entry.seq
            if seq is None or seq <= last:
                self._problem(f"{path} line {line_no}: not a journal entry; skipped")
                continue
            last = seq
        return last

    def _read_segment(self, path: str) -> Iterator[Entry]:
        """The entries of the segment at ``path``; a line that is not one, or whose ``seq`` is
        not above the previous entry's, is reported and skipped."""
        last = -1
        for line_no, line in self._lines(path):
            entry = _parse(line)
            if entry is None or entry.seq <= last:
                self._problem(f"{path} line {line_no}: not a journal entry; skipped")
                continue
            last = entry.seq
            yield entry

    def _lines(self, path: str) -> Iterator[tuple[int, bytes]]:
        """The complete lines of the segment at ``path`` with their numbers; one cut short or
        too long, or a file that cannot be opened, is reported."""
        try:
            descriptor = open_regular(path, os.O_RDONLY, _ROLE)
        except (TrackerFileError, OSError) as error:
            self._problem(short(str(error), 300))
            return
        with open(descriptor, "rb") as file:
            for line_no, (line, complete) in enumerate(read_lines(file, _MAX_LINE), 1):
                if line is None or not complete:
                    self._problem(f"{path} line {line_no}: cut short or too long; skipped")
                    continue
                yield line_no, line

    def drop_after(self, step: int) -> int:
        """Remove the entries whose step is after ``step`` (a resumed run logs them again).

        Rewrites each segment that holds some (a temporary file renamed over it). Returns how
        many were removed.
        """
        removed = 0
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for index, (first, path, _) in enumerate(list(self._segments)):
            kept = []
            count = 0
            for entry in self._read_segment(path):
                if entry.step > step:
                    count += 1
                else:
                    kept.append(entry)
            if not count:
                continue
            removed += count
            temporary = path + ".tmp"
            check_regular(temporary, _ROLE)
            descriptor = open_regular(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _ROLE)
            data = "".join(_line(entry) for entry in kept).encode()
            try:
                os.write(descriptor, data)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(temporary, path)
            self._segments[index] = (first, path, len(data))
        return removed

    def status(self, name: str) -> JournalStatus:
        """Counts for ``accelkit track status``."""
        pending = len(self.pending())
        run = self.read_run()
        reference = run.get("reference") if run else None
        return JournalStatus(
            name=name,
            folder=self.folder,
            journaled=self.next_seq,
            delivered=min(self.acked + 1, self.next_seq),
            pending=pending,
            reference=reference if isinstance(reference, dict) else None,
            problems=tuple(self.problems),
        )

    def set_aside(self) -> str | None:
        """Move this journal to ``<folder>-<time>`` (a previous run's, kept for ``track sync``;
        or a damaged one, kept to look at) or remove it when everything was delivered; returns
        the new folder (``None``: removed)."""
        self.close()
        if not self.problems and not self.pending(limit=1):
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        target = f"{self.folder}-{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = 0
        while os.path.lexists(target if not suffix else f"{target}-{suffix}"):
            suffix += 1
        target = target if not suffix else f"{target}-{suffix}"
        os.rename(self.folder, target)
        return target


class AckRecord:
    """A journal's durable acknowledgement record, the file ``acked``: two lines of 20
    digits, the ``seq`` of the last delivered entry and of the last entry (or batch) being
    sent (:meth:`Journal.sending`, :meth:`Journal.ack`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._map_failed = False

    def read(self, problem: Callable[[str], None]) -> tuple[int, int | None]:
        """``(acked, sending)`` as recorded (``-1`` and ``None`` without a record); a record
        that cannot be read is reported to ``problem`` and taken as all delivered."""
        path = self.path
        try:
            if not check_regular(path, _ROLE):
                return -1, None
            descriptor = open_regular(path, os.O_RDONLY, _ROLE)
            try:
                data = os.read(descriptor, 64)
            finally:
                os.close(descriptor)
        except OSError as error:
            problem(f"{short(str(error), 300)}; treated as all delivered")
            return 2**62, None
        lines = data.decode("ascii", "replace").split("\n")
        text = lines[0].strip()
        if not text:
            return -1, None
        acked = _number(text)
        if acked is None:
            # Unknown: assume every entry was delivered, so nothing can be sent twice; the
            # entries stay on disk for a user who knows better.
            problem(f"{path}: not a number ({short(text, 40)}); treated as all delivered")
            return 2**62, None
        sending = _number(lines[1].strip()) if len(lines) > 1 else None
        return acked, sending

    def _file(self) -> int:
        if self._fd is None:
            self._fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT, _ROLE)
        return self._fd

    def mark(self, acked: int, sending: int) -> None:
        """Rewrite ``acked`` in place: into a shared memory map of the file when the system
        allows one (no system call: the worker marks two per entry it sends), else one
        ``pwrite``. Either way the bytes are in the page cache at once, so a process killed
        right after still leaves them (a power cut may not: :meth:`sync` for that).
        Raises ``OSError``."""
        data = b"%020d\n%020d\n" % (acked, sending)
        view = self._map
        if view is None:
            if self._map_failed:
                os.pwrite(self._file(), data, 0)
                return
            view = self._open_map()
            if view is None:
                os.pwrite(self._file(), data, 0)
                return
        view[:_ACK_SIZE] = data

    def _open_map(self) -> mmap.mmap | None:
        try:
            descriptor = open_regular(self.path, os.O_RDWR | os.O_CREAT, _ROLE)
        except OSError:
            self._map_failed = True
            return None
        try:
            if os.fstat(descriptor).st_size != _ACK_SIZE:
                os.ftruncate(descriptor, _ACK_SIZE)
            self._map = mmap.mmap(
                descriptor, _ACK_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except (OSError, ValueError):
            self._map_failed = True  # a file system without shared maps: pwrite
            os.close(descriptor)
            return None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = descriptor
        return self._map

    def sync(self) -> None:
        """Flush the record to the disk (``fsync``)."""
        if self._map is not None:
            self._map.flush()
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """Sync (as far as it can) and close the file."""
        if self._map is not None:
            try:
                self._map.flush()
            except OSError:
                pass
            self._map.close()
            self._map = None
        _close_synced(self._fd)
        self._fd = None


def _close_synced(descriptor: int | None) -> None:
    """``fsync`` (as far as it can) and close ``descriptor``, if there is one."""
    if descriptor is None:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    os.close(descriptor)


def _number(text: str) -> int | None:
    """A sequence number written by :meth:`Journal.ack` (``-1`` included), else ``None``."""
    if not 1 <= len(text) <= 20 or not text.lstrip("-").isdigit() or text.count("-") > 1:
        return None
    value = int(text)
    return value if -1 <= value < 2**62 else None


def _line(entry: Entry) -> str:
    record: dict[str, Any] = {
        "seq": entry.seq,
        "kind": entry.kind,
        "step": entry.step,
        "time": entry.time,
        "values": entry.values,
    }
    if entry.extra:
        record["extra"] = entry.extra
    try:
        return _encode(record) + "\n"
    except (TypeError, ValueError):
        record["values"] = to_plain(entry.values)
        record["extra"] = to_plain(entry.extra)
        return json.dumps(record, separators=(",", ":"), default=str) + "\n"


def _parse(line: bytes) -> Entry | None:
    """One line as an :class:`Entry`, or ``None`` when it is not one (never raises)."""
    try:
        # Decoded first: json.loads on bytes guesses the encoding of every line (a third slower).
        record = json.loads(line.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(record, dict):
        return None
    seq, kind, step = record.get("seq"), record.get("kind"), record.get("step")
    values, extra = record.get("values"), record.get("extra", {})
    moment = record.get("time", 0.0)
    if (
        type(seq) is not int
        or seq < 0
        or kind not in ("log", "config", "event")
        or type(step) is not int
        or not isinstance(values, dict)
        or not isinstance(extra, dict)
        or not isinstance(moment, (int, float))
    ):
        return None
    return Entry(seq, kind, step, float(moment), values, extra)
