"""Sending later what a run could not deliver: the work behind ``accelkit track sync``/``status``.

A run whose backend did not come back (or a job killed while it was catching up) leaves
undelivered entries in its trackers' journals (:mod:`accelkit.trackers.delivery.journal`).
:func:`sync` opens the same run again (the reference is in the journal's ``run.json``: the
tracker's ``continue_run`` before its ``start``, as a resumed job does), sends the entries after
the last acknowledged one in order with their original steps, recording each as delivered right
after the backend accepts it, and finishes the run. Run it once the job has ended: a journal is
written by one process at a time.

What sync trusts: ``run.json`` is read as untrusted input (a journal may come from a copied
project or an archive). The tracker's name must be a built-in or registered tracker; every
local path sync would derive from the file must stay inside the logging directory the journal
lives under (:func:`check_run_paths`): the run folder of a tracker that writes under the
logging directory (``project_name`` for jsonl, TensorBoard and trackers like them), and every
``init_kwargs`` value whose key names a place (``dir``, ``*_dir``, ``*_path``, ``*_uri``,
``*_location``, ...: W&B's ``dir``, MLflow's ``tracking_uri`` as a sqlite or file store, ...).
A value leading elsewhere (``..``, an absolute path, a link out) is refused before the tracker
is built, so nothing outside is touched. A network address (``http://``, ``s3://``,
``databricks``, ...) is the backend's and is trusted as the journal's owner wrote it: sync
sends the journal's values there, with the credentials of the environment it runs in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from accelkit._text import short
from accelkit.trackers.backends._files import TrackerFileError, inside
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.delivery.journal import Entry, Journal, JournalStatus, journal_folders
from accelkit.trackers.delivery.send import deliver
from accelkit.trackers.registry import constructor_arguments, get_tracker_class

__all__ = ["SyncResult", "check_run_paths", "status", "sync", "sync_folder"]


@dataclass
class SyncResult:
    """What :func:`sync` did for one journal.

    Attributes:
        name: the tracker's name.
        folder: the journal's folder.
        sent: entries delivered now.
        first_seq: the first entry sent (``None``: none).
        last_seq: the last entry sent (``None``: none).
        pending: entries still undelivered afterwards.
        error: why it stopped early (``None``: it did not).
        problems: what could not be read in the journal, one line each.
    """

    name: str
    folder: str
    sent: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    pending: int = 0
    error: str | None = None
    problems: list[str] = field(default_factory=list)


def _load(folder: str) -> Journal:
    journal = Journal(folder)
    journal.load()
    return journal


def status(logging_dir: str) -> list[JournalStatus]:
    """Per journal under ``logging_dir``: entries journaled, delivered and pending."""
    out = []
    for folder in journal_folders(logging_dir):
        journal = _load(folder)
        out.append(journal.status(os.path.basename(folder)))
    return out


def sync(
    logging_dir: str,
    tracker: str | None = None,
    *,
    on_sent: Callable[[Entry], None] | None = None,
    allow_outside: bool = False,
) -> list[SyncResult]:
    """Deliver every journal's undelivered entries under ``logging_dir`` to its run.

    Args:
        logging_dir: the run's logging directory.
        tracker: only the journals of this tracker (its name).
        on_sent: called after each delivered entry.
        allow_outside: let ``run.json`` name local paths outside ``logging_dir`` (see
            :func:`check_run_paths`; only for a journal you wrote yourself).

    Returns:
        One :class:`SyncResult` per journal looked at.
    """
    results = []
    for folder in journal_folders(logging_dir):
        journal = _load(folder)
        run = journal.read_run() or {}
        name = run.get("tracker")
        if not isinstance(name, str) or not name:
            name = os.path.basename(folder).split(".rank", 1)[0]
        if tracker is not None and name != tracker:
            continue
        result = SyncResult(name, folder, problems=list(journal.problems))
        results.append(result)
        if not journal.pending(limit=1):
            continue
        try:
            instance = _build(name, run, logging_dir, allow_outside)
        except Exception as error:
            result.error = f"{type(error).__name__}: {error}"
            result.pending = len(journal.pending())
            continue
        sync_folder(instance, journal, run.get("reference"), result, on_sent)
    return results


def _build(
    name: str, run: dict[str, object], logging_dir: str, allow_outside: bool
) -> GeneralTracker:
    cls = get_tracker_class(name)
    if not allow_outside:
        check_run_paths(cls, run, logging_dir)
    project = run.get("project_name")
    kwargs = run.get("init_kwargs")
    args, named = constructor_arguments(
        cls,
        project if isinstance(project, str) else "",
        logging_dir,
        kwargs if isinstance(kwargs, dict) else {},
    )
    return cls(*args, **named)


# init_kwargs keys that name a place: their local paths must stay in the logging directory.
_PLACE_KEYS = frozenset({"dir", "path", "directory", "folder", "logdir", "root", "uri"})
_PLACE_ENDINGS = ("_dir", "_directory", "_folder", "_path", "_file", "_uri", "_location")


def check_run_paths(cls: type[GeneralTracker], run: Mapping[str, Any], logging_dir: str) -> None:
    """Refuse a ``run.json`` (untrusted) whose local paths lead outside ``logging_dir``.

    Checked: ``project_name`` for a tracker with ``requires_logging_directory`` (its run
    folder, ``<logging_dir>/<project_name>``), and every string in ``init_kwargs`` (nested
    mappings included) under a key that names a place (``dir``, ``path``, ``root``, ``uri``,
    ``*_dir``, ``*_directory``, ``*_folder``, ``*_path``, ``*_file``, ``*_uri``,
    ``*_location``) that is a local path: a plain path (relative ones from the current
    folder, as the backend opens them), a ``file:`` URI or a ``sqlite:`` URL. Links are
    resolved. Network addresses (``http://``, ``s3://``, ``postgresql://``, ...) are not paths
    and pass.

    Args:
        cls: the tracker class ``run.json`` names.
        run: what ``run.json`` holds.
        logging_dir: the logging directory the journal lives under.

    Raises:
        TrackerFileError: a path leads outside ``logging_dir``; the message names the value,
            what was expected and the fix.
    """
    project = run.get("project_name")
    if (
        cls.requires_logging_directory
        and isinstance(project, str)
        and not inside(logging_dir, os.path.join(logging_dir, project))
    ):
        raise _outside("project_name (the run folder under it)", project, logging_dir)
    kwargs = run.get("init_kwargs")
    if isinstance(kwargs, Mapping):
        for where, value in _places(kwargs, "init_kwargs"):
            path = _local_path(value)
            if path is not None and not inside(logging_dir, path):
                raise _outside(where, value, logging_dir)


def _places(values: Mapping[Any, Any], where: str, depth: int = 0) -> Iterator[tuple[str, str]]:
    """``(where, value)`` for each string under a place key in ``values`` (nested)."""
    for key, value in values.items():
        here = f"{where}[{short(key, 40)}]"
        if isinstance(value, Mapping) and depth < 8:
            yield from _places(value, here, depth + 1)
        elif isinstance(value, str) and isinstance(key, str):
            lowered = key.lower()
            if lowered in _PLACE_KEYS or lowered.endswith(_PLACE_ENDINGS):
                yield here, value


def _local_path(value: str) -> str | None:
    """The local path ``value`` names (a path, ``file:`` or ``sqlite:``), ``None``: a network
    address (or sqlite in memory)."""
    scheme, colon, rest = value.partition(":")
    if not colon or len(scheme) == 1 or not scheme.replace("+", "").replace("-", "").isalnum():
        return value  # no scheme (or a drive letter): a path
    scheme = scheme.lower()
    if scheme == "file":
        return urlparse(value).path or "."
    if scheme == "sqlite" or scheme.startswith("sqlite+"):
        path = rest[3:] if rest.startswith("///") else ""  # sqlite:///rel, sqlite:////abs
        return path or None
    return None


def _outside(what: str, value: str, logging_dir: str) -> TrackerFileError:
    return TrackerFileError(
        f"run.json's {what} {short(value, 300)} leads outside the logging directory "
        f"{short(logging_dir, 300)}: expected a path inside it. A journal may come from a "
        "copied project or an archive, so track sync writes only under the logging directory "
        "the journal lives in (nothing was touched). If this journal is your own and its run "
        "did write there, run `accelkit track sync LOGGING_DIR --allow-outside`; otherwise "
        "correct or remove the journal's run.json."
    )


def sync_folder(
    tracker: GeneralTracker,
    journal: Journal,
    reference: object,
    result: SyncResult,
    on_sent: Callable[[Entry], None] | None = None,
) -> SyncResult:
    """Continue ``reference``'s run with ``tracker`` and send ``journal``'s undelivered
    entries (for a tracker :func:`sync` cannot build: one not registered in this process)."""
    last_step = journal.last_step()

    def sent(entry: Entry) -> None:
        result.sent += 1
        if result.first_seq is None:
            result.first_seq = entry.seq
        result.last_seq = entry.seq
        if on_sent is not None:
            on_sent(entry)

    started = False
    try:
        if isinstance(reference, dict):
            tracker.continue_run(dict(reference), last_step)
        tracker.start()
        started = True
        deliver(tracker, journal, sent)
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        try:
            if started:
                tracker.finish()
        except Exception as error:
            result.error = result.error or f"finish(): {type(error).__name__}: {error}"
        journal.close()
    result.pending = len(journal.pending())
    result.problems = list(journal.problems)
    return result
