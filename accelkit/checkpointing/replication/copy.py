"""Copy one committed checkpoint to another tier: the commit protocol, a second time.

The one path every replication runs (the background :class:`~accelkit.checkpointing.
replication.replicator.Replicator` and ``accelkit ckpt sync``):

1. read the local manifest (the checkpoint must be committed there);
2. if the remote folder already holds the same committed manifest, stop (nothing to do); a
   remote folder committed with *another* manifest is refused (never overwritten);
3. write the save marker first (what proves to ``ckpt prune`` that accelkit wrote the folder),
   un-committing nothing: a remote folder without a manifest is incomplete by definition;
4. stream each file the manifest lists from the local tier to the remote one, verifying what
   is read against the manifest's size and checksum (the checksums the save wrote inline; the
   remote bytes are not hashed again) before the upload is committed;
5. remove files of an earlier, interrupted copy that the manifest does not list;
6. write the manifest last (:func:`~accelkit.checkpointing.formats.manifest.write_manifest`,
   one PUT on an object store), so the remote checkpoint is committed only when complete.

Every remote operation is retried under a :class:`~accelkit.delivery.retry.RetryPolicy`
(transient errors only), per file: an outage in the middle of a checkpoint redoes
the file it cut, not the ones already uploaded. Files are uploaded one at a time
(:data:`UPLOAD_WORKERS`), each read from the local tier straight into the part buffers of its
upload (an S3 remote: no read buffer, no copy; another storage gets one :data:`READ_CHUNK`
buffer), at most :data:`UPLOAD_PARTS_IN_FLIGHT` parts waiting for the server: about 53 MB above
the process's resident set for a 252 MB checkpoint, within the budget of 64 MB plus one read
buffer (``benchmarks/bench_replication.py``, which also compares its upload with s3fs
``put_file`` of the same files).

Public API: :func:`replicate_checkpoint`, :func:`same_checkpoint`, :func:`copy_file` (one
file, verified: also what the memory tier's promotion copies with), :class:`Replicated`,
:data:`READ_CHUNK`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from accelkit._text import short
from accelkit.checkpointing.commit.deletion import remove_folder
from accelkit.checkpointing.commit.protocol import save_marker
from accelkit.checkpointing.errors import CheckpointError, CheckpointPathError
from accelkit.checkpointing.formats.layout import (
    MANIFEST_NAME,
    SAVE_MARKER_NAME,
    check_relative_path,
)
from accelkit.checkpointing.formats.manifest import FileEntry, Manifest, read_manifest
from accelkit.checkpointing.formats.manifest import write_manifest as _write_manifest
from accelkit.checkpointing.storage import Storage, join, parts_in_flight
from accelkit.checkpointing.storage.confined import confine
from accelkit.checkpointing.storage.retry import copy_stream
from accelkit.checkpointing.storage.verified import check_expected, open_verified
from accelkit.delivery.retry import RetryPolicy, retry_call

__all__ = [
    "READ_CHUNK",
    "UPLOAD_PARTS_IN_FLIGHT",
    "UPLOAD_WORKERS",
    "Replicated",
    "copy_file",
    "replicate_checkpoint",
    "same_checkpoint",
]

READ_CHUNK = 8 * 1024 * 1024
"""Bytes read from the local tier at a time when the remote storage cannot be filled in place
(one buffer per file in flight; an S3 upload is read straight into its part buffers)."""

UPLOAD_PARTS_IN_FLIGHT = 2
"""Parts of an S3 upload in flight at once (16 MiB each, plus the one being read into). The
budget is 64 MB plus one read buffer (issue #26); measured in a fresh process replicating a
252 MB checkpoint to a local SeaweedFS: 35 MB extra with 1 part in flight, 53 MB with 2
(``benchmarks/bench_replication.py``). Where the memory went before (97 MB with 1 part,
tracemalloc at the peak): two part buffers (34 MB), the 8 MiB read buffer, and three
transient copies of the part being sent that aiohttp and asyncio made of a ``bytearray`` body
on Python 3.11 (41 MB); parts are now ``io.BytesIO`` bodies streamed without a copy, filled
straight from the local file. 2, not 1: the upload keeps pace with s3fs ``put_file`` (one part
in flight left the server idle while the next part was read)."""

UPLOAD_WORKERS = 1
"""Files of one checkpoint uploaded at the same time (each adds a read buffer and a part)."""

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replicated:
    """What one replication did.

    Attributes:
        source: the local checkpoint folder.
        target: the remote checkpoint folder.
        manifest: the checkpoint's manifest (the same on both tiers).
        bytes: bytes uploaded (0 if the remote tier already had it).
        files: files uploaded.
        seconds: wall time of the copy.
        already: the remote tier already held this checkpoint, committed.
    """

    source: str
    target: str
    manifest: Manifest
    bytes: int
    files: int
    seconds: float
    already: bool = False


def same_checkpoint(a: Manifest, b: Manifest) -> bool:
    """Whether the manifests ``a`` and ``b`` commit the same checkpoint: the same iteration and
    the same files with the same sizes and checksums.

    How the tiers are compared (the replicator's catch-up, ``accelkit ckpt sync``, ``accelkit
    ckpt ls --remote``): by content, never by folder name, since a remote folder of the same
    name may hold another run's checkpoint. The rest of the manifest (creation time, the
    tracker runs completed after the commit) may differ between two copies of one checkpoint.
    """
    return a.iteration == b.iteration and {e.path: (e.size, e.checksum) for e in a.files} == {
        e.path: (e.size, e.checksum) for e in b.files
    }


def copy_file(local: Storage, source: str, entry: FileEntry, remote: Storage, target: str) -> int:
    """Stream the file ``source`` to ``target``, verified against ``entry`` (its size and
    checksum in the manifest it comes from); the write commits only if it verifies. Returns the
    bytes copied."""
    reader = open_verified(local, source, entry)
    try:
        with parts_in_flight(UPLOAD_PARTS_IN_FLIGHT):  # the replicator's memory budget
            sink = remote.open_sink(target)
        try:
            fill = getattr(sink, "fill", None)
            if fill is not None:  # S3: read straight into the part being filled, no copy
                while fill(reader.readinto, entry.size - reader.size):
                    pass
            else:
                copy_stream(reader, sink, min(READ_CHUNK, max(entry.size, 1)))
            # The reader is at the end of the file: the local bytes are the ones the save
            # hashed, or nothing is committed (no read past the end: verify() would make one).
            check_expected(reader.url, entry, reader.size, reader.checksum)
        except BaseException:
            with contextlib.suppress(Exception):
                sink.abort()
            with contextlib.suppress(Exception):
                remote.remove(target)
            raise
        sink.commit(False)
    finally:
        reader.close()
    return entry.size


def replicate_checkpoint(
    local: Storage,
    source: str,
    remote: Storage,
    target: str,
    retry: RetryPolicy,
    should_stop: Callable[[], bool] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    workers: int = UPLOAD_WORKERS,
    rewrite: Callable[[Manifest], Manifest] | None = None,
) -> Replicated:
    """Copy the committed checkpoint ``source`` to ``target`` and commit it there (see the
    module docstring).

    Args:
        local: the storage of ``source``.
        source: a committed checkpoint folder.
        remote: the storage of ``target``.
        target: the folder to create (``<replicate_to>/checkpoints/checkpoint_<n>``).
        retry: how transient remote errors are retried (per operation, per file).
        should_stop: ends the retries early (the run is shutting down).
        sleep: how to wait between retries.
        workers: files uploaded at the same time (each with its own read buffer).
        rewrite: what the copy's manifest says, from the source's (the same files: ``accelkit
            ckpt fork`` records the lineage); ``None``: the source's manifest.

    Raises:
        CheckpointError: ``source`` is not committed, or ``target`` holds another committed
            checkpoint; nothing was written then.
        CorruptCheckpointError: a local file disagrees with the manifest (the remote folder
            stays uncommitted).
        OSError: a hard remote error, or a transient one the policy gave up on (the remote
            folder stays uncommitted; running again resumes).
    """
    started = time.perf_counter()

    def step(what: str, fn: Callable[[], T]) -> T:
        return retry_call(fn, retry, what, should_stop=should_stop, sleep=sleep)

    local = confine(local, source)
    manifest = read_manifest(local, source)
    if manifest is None:
        raise CheckpointError(
            f"{source} is not a committed checkpoint (it has no {MANIFEST_NAME}), so it is not "
            "replicated. `accelkit ckpt ls` shows its state."
        )
    if rewrite is not None:
        manifest = rewrite(manifest)
    existing = step(f"reading {target}", lambda: _remote_manifest(remote, target))
    if existing is not None and same_checkpoint(existing, manifest):
        damage = step(f"listing {target}", lambda: _size_damage(remote, target, manifest))
        if not damage:
            seconds = time.perf_counter() - started
            return Replicated(source, target, manifest, 0, 0, seconds, already=True)
        # Our own manifest over files that disagree with it (cut, grown, missing): un-commit
        # the remote copy, then copy it again like an interrupted one.
        logger.warning(
            "The remote copy %s is damaged (%s); it is un-committed and copied again from %s.",
            target,
            damage,
            source,
        )
        step(f"un-committing {target}", lambda: remote.remove(join(target, MANIFEST_NAME)))
        existing = None
    if existing is not None:
        raise CheckpointPathError(
            f"{target} already holds another committed checkpoint (its manifest differs from "
            f"{source}'s); accelkit never overwrites a committed checkpoint, so it was not "
            "replicated. Give each run its own replicate_to, or remove the remote one with "
            "`accelkit ckpt prune`."
        )
    step(
        f"marking {target}",
        lambda: remote.write_bytes(
            join(target, SAVE_MARKER_NAME), save_marker(replicated_from=source), atomic=True
        ),
    )

    def upload(entry: FileEntry) -> int:
        src, dst = join(source, entry.path), join(target, entry.path)
        return step(
            f"upload of {dst}", functools.partial(copy_file, local, src, entry, remote, dst)
        )

    # Biggest first, `workers` at a time: an object store takes parallel uploads faster than one
    # stream (as s3fs's put_file sends parts in parallel); each upload has its own buffer.
    ordered = sorted(manifest.files, key=lambda e: -e.size)
    if workers > 1 and len(ordered) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="accelkit-upload") as pool:
            uploaded = sum(pool.map(upload, ordered))
    else:
        uploaded = sum(upload(entry) for entry in ordered)
    listed = {e.path for e in manifest.files} | {SAVE_MARKER_NAME}
    present = step(f"listing {target}", lambda: confine(remote, target).walk_files(target))
    for rel in present:
        if rel not in listed:  # left by an earlier, interrupted copy
            _check_key(target, rel)
            step(f"removing {rel}", functools.partial(remote.remove, join(target, rel)))
    step(f"commit of {target}", lambda: _write_manifest(remote, target, manifest))
    seconds = time.perf_counter() - started
    return Replicated(source, target, manifest, uploaded, len(manifest.files), seconds)


def _check_key(target: str, rel: str) -> None:
    """Refuse to act on a remote name that is no plain path inside ``target`` (a key with
    ``..``, an empty component or a leading ``/``: a crafted bucket's, never one accelkit
    wrote)."""
    try:
        check_relative_path(rel, what=f"a file under {target}")
    except ValueError as exc:
        raise CheckpointPathError(
            f"{target} holds {short(rel)}, which is no plain path inside it ({exc}); nothing "
            "there was removed. Remove the remote folder by hand (or with `accelkit ckpt "
            "prune`), then replicate again."
        ) from None


def _size_damage(remote: Storage, target: str, manifest: Manifest) -> str:
    """What is wrong with the sizes of the remote copy ``target`` (``""``: nothing); one
    listing, no bytes read."""
    remote.invalidate(target)
    present = confine(remote, target).walk_files(target)
    problems = [
        f"{e.path}: {present.get(e.path, 'missing')} bytes, expected {e.size}"
        for e in manifest.files
        if present.get(e.path) != e.size
    ]
    return "; ".join(problems[:3]) + (
        f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    )


def _remote_manifest(remote: Storage, target: str) -> Manifest | None:
    remote.invalidate(target)
    if not remote.exists(join(target, MANIFEST_NAME)):
        return None
    return read_manifest(remote, target)


def discard_incomplete(remote: Storage, target: str) -> None:
    """Remove an uncommitted remote copy (marker last), as a failed save's folder is."""
    remove_folder(remote, target)
