"""Convert a Hugging Face accelerate checkpoint folder into a committed accelkit checkpoint.

What ``accelkit ckpt import SRC [DST]`` runs. ``SRC`` is read exactly as ``load_state`` reads
it (:func:`~accelkit.checkpointing.interop.accelerate_format.read_accelerate`: confined, pickles
through ``torch.load(weights_only=True)`` and an exact allow-list) and never written to. ``DST``
gets accelkit's files: weights in safetensors, every state in JSON + safetensors, one
``random_states_<rank>`` per process that saved ``SRC``; then the manifest (the commit), then
every file is read back and checked against it.

An import is a save: it holds the save lock of ``DST``'s project
(:class:`~accelkit.checkpointing.commit.lock.RunLock`, role ``import``) from the moment it picks
``DST`` until the commit, so a training run saving into that project and a prune wait for it
(and it for them) instead of racing for a ``checkpoint_<n>`` name or deleting the folder half
written. ``DST`` is created exclusively with the save marker in it
(:func:`~accelkit.checkpointing.commit.lock.claim_folder`: an existing folder is never written into,
and an interrupted import is an ``incomplete`` folder that ``accelkit ckpt prune`` may remove),
then the data files flushed, the manifest last and atomic. A training save whose next number
an import took moves past it (:mod:`~accelkit.checkpointing.commit.protocol`). ``DST`` equal to
``SRC``, inside it or holding it (after resolving links) is refused before anything is written.

Public API: :func:`import_accelerate` -> :class:`ImportResult`; :func:`default_destination`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from accelkit._version import __version__
from accelkit.checkpointing.catalog.listing import ACCELERATE, inspect_folder, list_checkpoints
from accelkit.checkpointing.catalog.listing import next_iteration as _next_free
from accelkit.checkpointing.commit.deletion import project_of, remove_folder
from accelkit.checkpointing.commit.lock import IMPORT, RunLock, claim_folder
from accelkit.checkpointing.commit.per_process import resolve_folder
from accelkit.checkpointing.commit.protocol import save_marker
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.layout import (
    SAVE_MARKER_NAME,
    checkpoint_name,
    custom_stem,
    dataloader_stem,
    object_stem,
    parse_checkpoint_name,
    random_states_stem,
)
from accelkit.checkpointing.formats.manifest import (
    FileEntry,
    Manifest,
    file_checksum,
    verify_files,
    write_manifest,
)
from accelkit.checkpointing.interop.accelerate_format import AccelerateCheckpoint, read_accelerate
from accelkit.checkpointing.objects.contents import Snapshot, write_snapshot
from accelkit.checkpointing.storage import Storage, get_storage, join, sync_batch
from accelkit.checkpointing.storage.base import StorageNotFoundError
from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM
from accelkit.checkpointing.storage.confined import confine
from accelkit.errors import ConfigurationError

__all__ = ["ImportResult", "default_destination", "import_accelerate"]

logger = logging.getLogger(__name__)

_CLAIM_TRIES = 5  # a default name taken by a writer that ignores the lock: try the next one


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_accelerate` wrote.

    Attributes:
        source: the Accelerate folder.
        destination: the new accelkit checkpoint.
        manifest: its manifest (``step`` is Accelerate's ``step``; ``metadata.imported_from``
            names the source).
    """

    source: str
    destination: str
    manifest: Manifest


def _parent(path: str) -> str:
    stripped = path.rstrip("/")
    return stripped.rpartition("/")[0] or "."


def default_destination(storage: Storage, source: str) -> str:
    """``checkpoint_<n>`` beside ``source``, ``n`` the next number no folder there uses."""
    parent = _parent(source)
    return join(parent, checkpoint_name(_next_free(list_checkpoints(storage, parent))))


def _snapshot(source: str, storage: Storage) -> tuple[Snapshot, AccelerateCheckpoint]:
    checkpoint = read_accelerate(confine(storage, source), source)
    snap = Snapshot()
    snap.models = [(object_stem("model", i), sd) for i, sd in enumerate(checkpoint.models)]
    for kind, items in (("optimizer", checkpoint.optimizers), ("scheduler", checkpoint.schedulers)):
        snap.states += [(object_stem(kind, i), state) for i, state in enumerate(items)]
    if checkpoint.scaler is not None:
        snap.states.append(("scaler", checkpoint.scaler))
    snap.states += [(dataloader_stem(i), s) for i, s in sorted(checkpoint.dataloaders.items())]
    snap.states += [(custom_stem(i), state) for i, state in enumerate(checkpoint.custom)]
    snap.states += [(random_states_stem(r), s) for r, s in sorted(checkpoint.rng.items())]
    return snap, checkpoint


def import_accelerate(
    source: str,
    destination: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ImportResult:
    """Convert the Accelerate checkpoint folder ``source`` into a committed, verified accelkit
    checkpoint at ``destination``; ``source`` is only read.

    Args:
        source: a folder written by Hugging Face accelerate's ``save_state`` (path or URL).
        destination: where to write (path or URL); default :func:`default_destination`.
        storage_options: fsspec options for both.

    Returns:
        An :class:`ImportResult`.

    Raises:
        FileExistsError: ``destination`` exists (nothing is written into it).
        ValueError: ``destination`` is ``source``, inside it or holds it (after resolving
            links).
        CheckpointError: ``source`` is not an Accelerate checkpoint (the message says what it
            is).
        CorruptCheckpointError: a file of ``source`` is refused (naming it and the global it
            wanted), or the written checkpoint does not verify.
    """
    src_storage = get_storage(source, storage_options)
    if not src_storage.isdir(source):
        raise StorageNotFoundError(
            f"{source!r} is not a folder: give the Accelerate checkpoint folder."
        )
    info = inspect_folder(src_storage, source)
    if info.state != ACCELERATE:
        raise CheckpointPathError(
            f"{source} is not a checkpoint written by Hugging Face accelerate (state "
            f"{info.state!r}{': ' + info.error if info.error else ''}). Give a folder that "
            "save_state of accelerate wrote (optimizer.bin, random_states_0.pkl, ...)."
        )
    chosen = destination
    dst_storage = get_storage(chosen or source, storage_options)
    if chosen is not None:
        _refuse_overlap(source, chosen)
        if dst_storage.exists(chosen):  # checked again, exclusively, under the lock
            raise _exists(chosen)
    snapshot, checkpoint = _snapshot(source, src_storage)
    parent = _parent(chosen or source)
    lock = RunLock(dst_storage, project_of(parent), role=IMPORT)
    lock.acquire()
    try:
        destination = _claim(dst_storage, source, chosen)
        try:
            manifest = _write_and_commit(dst_storage, destination, source, snapshot, checkpoint)
        except BaseException:
            # The folder is ours (created above, holding our marker) and uncommitted: remove it
            # so that a retry can use the same name.
            try:
                remove_folder(dst_storage, destination)
            except Exception as exc:
                logger.warning(
                    "Could not remove the unfinished import %s (%s); `accelkit ckpt prune` "
                    "removes it.",
                    destination,
                    exc,
                )
            raise
    finally:
        lock.release()
    return ImportResult(source, destination, manifest)


def _exists(destination: str) -> FileExistsError:
    return FileExistsError(
        f"{destination!r} already exists; accelkit never imports over a folder. Give a new "
        "DST, or omit it to use the next free checkpoint_<n> beside the source."
    )


def _refuse_overlap(source: str, destination: str) -> None:
    """Refuse ``destination`` equal to ``source``, inside it or holding it, after resolving
    links (local paths) or normalising (URLs): writing there would change the source."""
    src, dst = resolve_folder(source), resolve_folder(destination)
    a, b = src.real.rstrip("/"), dst.real.rstrip("/")
    if a == b:
        where = "is the source folder"
    elif b.startswith(a + "/"):
        where = "is inside the source folder"
    elif a.startswith(b + "/"):
        where = "holds the source folder"
    else:
        return
    raise ConfigurationError(
        f"The destination {destination!r} {where} {source!r} (resolved: {dst.real} and "
        f"{src.real}): the import would write into the checkpoint it reads. Give a DST "
        "outside the source, e.g. omit it to use the next free checkpoint_<n> beside it; "
        "nothing was written."
    )


def _claim(storage: Storage, source: str, chosen: str | None) -> str:
    """Under the lock: create the destination exclusively (the next free ``checkpoint_<n>``
    beside ``source`` when none was given) and return it."""
    for _ in range(_CLAIM_TRIES):
        destination = chosen or default_destination(storage, source)
        _refuse_overlap(source, destination)
        try:
            claim_folder(storage, destination, SAVE_MARKER_NAME, save_marker(imported_from=source))
        except FileExistsError:
            if chosen is not None:
                raise _exists(chosen) from None
            continue  # taken since the listing by a writer that ignores the lock
        return destination
    raise CheckpointError(
        f"Could not claim a free checkpoint_<n> beside {source} after {_CLAIM_TRIES} tries: "
        "another process keeps creating folders there without the save lock. Give DST "
        "explicitly."
    )


def _write_and_commit(
    dst_storage: Storage,
    destination: str,
    source: str,
    snapshot: Snapshot,
    checkpoint: AccelerateCheckpoint,
) -> Manifest:
    size, checksum = file_checksum(
        dst_storage, join(destination, SAVE_MARKER_NAME), DEFAULT_ALGORITHM
    )
    files = {SAVE_MARKER_NAME: FileEntry(SAVE_MARKER_NAME, size, checksum)}
    with sync_batch():  # fsync each file while the next one is written
        written = write_snapshot(dst_storage, destination, snapshot)
    files.update((n, FileEntry.from_written(w, n)) for n, w in written.items())
    manifest = Manifest(
        iteration=parse_checkpoint_name(destination),
        step=checkpoint.steps,
        world_size=checkpoint.world_size,
        files=sorted(files.values(), key=_path),
        metadata={
            "imported_from": source,
            "imported_format": "accelerate",
            "accelerate_step": checkpoint.step,
        },
        accelkit_version=__version__,
        torch_version=torch.__version__,
    )
    write_manifest(dst_storage, destination, manifest)
    parent = _parent(destination)
    if parent:
        dst_storage.fsync_dir(parent)
    problems = verify_files(confine(dst_storage, destination), destination, manifest)
    if problems:
        raise CorruptCheckpointError(
            f"{destination}: the imported checkpoint does not verify: "
            f"{'; '.join(str(p) for p in problems)}. The storage may be failing; import again "
            "into a new folder."
        )
    return manifest


def _path(entry: FileEntry) -> str:
    return entry.path
