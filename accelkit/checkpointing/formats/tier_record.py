"""``.accelkit-replication.json``: the local project's record of its remote tier.

A project saved with ``replicate_to`` keeps, beside its run lock, one small JSON file written
by the replicator (the background one and ``accelkit ckpt sync``), so that ``accelkit ckpt ls
PROJECT`` shows each checkpoint's tier and replication lag without reaching the remote tier:

.. code-block:: json

    {"format": 1, "replicate_to": "s3://bucket/run", "updated": 1764124800.0,
     "checkpoints": {"checkpoint_3": {"committed": 1764124790.1, "replicated": 1764124796.4}}}

- ``replicate_to``: the remote tier's location **without** credentials: a URL's user and
  password, query string and fragment are removed (:func:`public_location`), and
  ``storage_options`` are never written;
- ``checkpoints``: the checkpoints committed on the remote tier as the replicator last saw them
  (those remote retention deleted are dropped), each with its local commit time (the
  manifest's ``created``) and its remote commit time (taken by the replicator right after the
  remote manifest was written; the storage layer has no modification times). The lag is
  ``replicated - committed``.

The file is replaced atomically (a temporary name renamed into place on a local disk, one PUT
on an object store), so a reader sees the old record or the new one.

**Threat.** A project folder is untrusted input, so is this file. It is read through
:func:`~accelkit.checkpointing.storage.confined.confine` (no link followed), at most
:data:`MAX_RECORD_BYTES`, with the one JSON reader, and every field is checked; a malformed
record is a :class:`TierRecordError` (callers ignore it with a note). Nothing here opens the
recorded location: ``accelkit ckpt ls`` shows it as text and contacts a remote tier only when the
user names it with ``--remote`` (a crafted record pointing at ``http://intranet-host/`` must not
make a listing reach that host).

Public API: :data:`RECORD_NAME`, :data:`MAX_RECORD_BYTES`, :data:`MAX_NAME_CHARS`,
:class:`TierRecord`, :class:`TierEntry`, :class:`TierRecordError`, :func:`public_location`,
:func:`read_record`, :func:`write_record`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from accelkit._text import short
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import parse_checkpoint_name
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.confined import confine

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_RECORD_BYTES",
    "RECORD_NAME",
    "TierEntry",
    "TierRecord",
    "TierRecordError",
    "public_location",
    "read_record",
    "write_record",
]

RECORD_NAME = ".accelkit-replication.json"
"""The record's file name, in the local ``project_dir`` (beside ``.accelkit-run.lock``)."""

MAX_RECORD_BYTES = 4 * 1024 * 1024
"""A record larger than this is refused unread (about 40,000 checkpoints)."""

MAX_LOCATION_CHARS = 4096
MAX_NAME_CHARS = 64
"""The longest checkpoint name a record may hold (``checkpoint_`` and 53 digits: far past any
iteration a run reaches). A longer one is a crafted record: its number would cost a
quadratic conversion, or fail Python's limit on digits, and its name would fill a table."""
FORMAT = 1


class TierRecordError(CorruptCheckpointError):
    """A ``.accelkit-replication.json`` that cannot be trusted (the message names the field)."""


@dataclass(frozen=True)
class TierEntry:
    """One checkpoint committed on the remote tier.

    Attributes:
        committed: its local commit time (UNIX seconds, the manifest's ``created``).
        replicated: its remote commit time (UNIX seconds); ``None`` when the replicator found
            it already committed there (an earlier run's copy) and the time is unknown.
    """

    committed: float
    replicated: float | None

    @property
    def lag_seconds(self) -> float | None:
        """Remote commit time minus local commit time (never negative); ``None`` if unknown."""
        return None if self.replicated is None else max(0.0, self.replicated - self.committed)


@dataclass
class TierRecord:
    """The parsed record (see the module docstring).

    Attributes:
        replicate_to: the remote tier, without credentials.
        updated: when the replicator last wrote it (UNIX seconds).
        checkpoints: ``checkpoint_<n>`` names committed on the remote tier, with their times.
    """

    replicate_to: str
    updated: float = 0.0
    checkpoints: dict[str, TierEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        """The file's text."""
        return json.dumps(
            {
                "format": FORMAT,
                "replicate_to": self.replicate_to,
                "updated": self.updated,
                "checkpoints": {
                    name: {"committed": e.committed, "replicated": e.replicated}
                    for name, e in sorted(
                        self.checkpoints.items(), key=lambda kv: parse_checkpoint_name(kv[0]) or 0
                    )
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, raw: bytes | str, source: str = RECORD_NAME) -> TierRecord:
        """Parse and check a record.

        Raises:
            TierRecordError: naming ``source`` and the bad field.
        """

        def bad(what: str) -> TierRecordError:
            return TierRecordError(f"{source}: {what}; it is ignored (delete it to silence this).")

        try:
            data = load_json(raw, source)
        except CorruptCheckpointError as exc:
            raise bad(f"not a valid record ({exc})") from None
        if not isinstance(data, dict):
            raise bad("expected a JSON object")
        if data.get("format") != FORMAT:
            raise bad(f"'format' must be {FORMAT}, got {short(data.get('format'))}")
        location = data.get("replicate_to")
        if not isinstance(location, str) or not location or len(location) > MAX_LOCATION_CHARS:
            raise bad(f"'replicate_to' must be a location of at most {MAX_LOCATION_CHARS} chars")
        updated = data.get("updated", 0.0)
        if not _time(updated):
            raise bad(f"'updated' must be a time in seconds, got {short(updated)}")
        entries = data.get("checkpoints", {})
        if not isinstance(entries, dict):
            raise bad("'checkpoints' must be an object")
        checkpoints: dict[str, TierEntry] = {}
        for name, entry in entries.items():
            if len(name) > MAX_NAME_CHARS or parse_checkpoint_name(name) is None:
                raise bad(
                    f"'checkpoints' names {short(name)}, not a checkpoint_<n> of at most "
                    f"{MAX_NAME_CHARS} characters"
                )
            if not isinstance(entry, dict):
                raise bad(f"'checkpoints'[{short(name)}] must be an object")
            committed, replicated = entry.get("committed", -1), entry.get("replicated")
            if not _time(committed) or not (replicated is None or _time(replicated)):
                raise bad(f"'checkpoints'[{short(name)}] needs 'committed' and 'replicated' times")
            checkpoints[name] = TierEntry(
                float(committed), None if replicated is None else float(replicated)
            )
        return cls(location, float(updated), checkpoints)


def _time(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value < 1e11
    )


def public_location(url: str) -> str:
    """``url`` without what may be a secret: a URL's user name and password, its query
    string (an Azure SAS token, a presigned signature) and fragment. Local paths are kept."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def read_record(storage: Storage, project: str) -> TierRecord | None:
    """The record of the local project ``project``; ``None`` if it has none.

    Raises:
        TierRecordError: it is malformed, too large, or a link.
    """
    view = confine(storage, project)
    url = join(project, RECORD_NAME)
    try:
        if not view.exists(url):
            return None
        size = view.size(url)
        if size > MAX_RECORD_BYTES:
            raise TierRecordError(
                f"{url}: {size} bytes, more than a record holds ({MAX_RECORD_BYTES}); it is "
                "ignored (delete it to silence this)."
            )
        raw = view.read_bytes(url, 0, MAX_RECORD_BYTES + 1)
    except CorruptCheckpointError as exc:  # a link
        raise TierRecordError(f"{url}: {exc}") from None
    return TierRecord.from_json(raw, url)


def write_record(storage: Storage, project: str, record: TierRecord) -> None:
    """Replace the record of ``project`` atomically."""
    storage.write_bytes(join(project, RECORD_NAME), record.to_json().encode(), atomic=True)
