"""What ``load_state`` checks before it restores anything, and what it says when it cannot.

- :func:`check_loadable` -- the folder as ``accelkit ckpt verify`` would judge it without reading
  checksums: a committed manifest, every listed file present with its size, no symbolic link
  anywhere inside (the checksums of the files loaded are checked while they are read). Anything
  else raises a :class:`~accelkit.checkpointing.errors.CheckpointError` that says what the path
  is and the likely fix: a typo (with the names that do exist), a file instead of a folder, a
  project or ``checkpoints`` folder (with its committed checkpoints), a save that did not
  finish, a folder written by somebody else, a damaged one. A folder written by Hugging Face
  accelerate's ``save_state`` passes (state ``accelerate``): it is read by
  :mod:`~accelkit.checkpointing.interop.accelerate_format`.
- :func:`check_owner` -- a per-process checkpoint (one whose manifest names its writer,
  :mod:`~accelkit.checkpointing.commit.per_process`) is loaded only by the process that wrote it.
- :func:`agree_on_load` -- every process learns whether any process failed to read its part,
  so all of them raise (the same kind of error) or none does.

:mod:`~accelkit.checkpointing.restore.sequence` runs them in its check and agree phases.

Public API: :func:`check_loadable`, :func:`check_owner`, :func:`agree_on_load`.
"""

from __future__ import annotations

import difflib

from accelkit.checkpointing.catalog.listing import (
    ACCELERATE,
    COMMITTED,
    CORRUPT,
    INCOMPLETE,
    CheckpointInfo,
    inspect_folder,
    list_checkpoints,
    loadable_automatic,
)
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.layout import CHECKPOINTS_DIRNAME, MANIFEST_NAME
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.confined import ConfinedStorage
from accelkit.runtime import ops

__all__ = ["agree_on_load", "check_loadable", "check_owner"]


def _parent(path: str) -> str:
    stripped = path.rstrip("/")
    return stripped.rpartition("/")[0] or "."


def _missing(storage: Storage, path: str) -> CheckpointError:
    parent = _parent(path)
    name = path.rstrip("/").rpartition("/")[2]
    hint = ""
    try:
        names = [e.name for e in storage.listdir(parent) if e.is_dir]
    except (FileNotFoundError, NotADirectoryError):
        names = []
    close = difflib.get_close_matches(name, names, n=3)
    if close:
        hint = f" Did you mean {', '.join(repr(join(parent, c)) for c in close)}?"
    elif names:
        hint = f" `accelkit ckpt ls {parent}` lists what is there."
    return CheckpointPathError(f"No checkpoint at {path}: it does not exist.{hint}")


def _project_or_root(storage: Storage, path: str) -> CheckpointError | None:
    """The error for a project folder or a ``checkpoints`` folder passed as a checkpoint."""
    candidate = join(path, CHECKPOINTS_DIRNAME)
    root = candidate if storage.isdir(candidate) else path
    infos = list_checkpoints(storage, root)
    if not infos:
        return None
    committed = loadable_automatic(infos)
    kind = "project folder" if root != path else "folder of checkpoints"
    if committed:
        newest = committed[-1].path
        return CheckpointPathError(
            f"{path} is a {kind} with {len(committed)} committed checkpoint(s), not one "
            f"checkpoint: call load_state() with no argument to load the newest (with "
            f"project_dir={path if root != path else _parent(path)!r}), or pass one of them, "
            f"e.g. load_state({newest!r})."
        )
    names = ", ".join(f"{i.name} ({i.state})" for i in infos)
    return CheckpointPathError(
        f"{path} is a {kind}, not one checkpoint, and none of its checkpoints is committed "
        f"({names}). Pass a committed checkpoint folder."
    )


def check_loadable(storage: Storage, path: str) -> CheckpointInfo:
    """Describe ``path`` and make sure ``load_state`` may restore from it.

    Args:
        storage: the storage of ``path``.
        path: what the user passed to ``load_state`` (or the newest committed checkpoint).

    Returns:
        Its :class:`~accelkit.checkpointing.catalog.listing.CheckpointInfo`, state ``committed`` or
        ``accelerate`` (a folder Hugging Face accelerate's ``save_state`` wrote).

    Raises:
        CorruptCheckpointError: a damaged checkpoint (bad manifest, a listed file missing or
            truncated, a symbolic link inside), naming the file.
        CheckpointError: anything else that is not a committed checkpoint, saying what it is.
    """
    # The path itself is looked at from outside (it is not yet known to be a folder).
    outside = storage.inner if isinstance(storage, ConfinedStorage) else storage
    if not outside.exists(path):
        raise _missing(outside, path)
    if outside.isfile(path) and not outside.is_symlink(path):
        raise CheckpointPathError(
            f"{path} is a file, not a checkpoint folder. Pass the folder that holds "
            f"{MANIFEST_NAME} (for model weights alone, use load_checkpoint_in_model)."
        )
    if not storage.exists(join(path, MANIFEST_NAME)):
        error = _project_or_root(storage, path)
        if error is not None:
            raise error
    info = inspect_folder(storage, path)
    if info.state in (COMMITTED, ACCELERATE):
        return info
    if info.state == CORRUPT:
        raise CorruptCheckpointError(
            f"{path} cannot be loaded: {info.error}. Nothing was restored; load another "
            "checkpoint (`accelkit ckpt verify` checks them)."
        )
    if info.state != INCOMPLETE:  # foreign
        raise CheckpointPathError(
            f"{path} is {info.error}. accelkit loads only checkpoints it committed "
            f"(with an {MANIFEST_NAME}); nothing was restored."
        )
    raise CheckpointPathError(
        f"{path} has no {MANIFEST_NAME}: it is an accelkit save that did not finish (it was "
        "interrupted, or is still being written). Load another checkpoint; `accelkit ckpt ls` "
        "lists them."
    )


def check_owner(manifest: Manifest, path: str, rank: int) -> None:
    """Refuse a per-process checkpoint that another process wrote.

    Raises:
        CheckpointError: ``path`` is the per-process checkpoint of a process other than
            ``rank``.
    """
    writer = manifest.process_index
    if writer is None or writer == rank:
        return
    raise CheckpointPathError(
        f"{path} is the checkpoint that process {writer} saved into a folder of its own (each "
        f"of the {manifest.world_size} processes saved into its own folder): it holds process "
        f"{writer}'s random states and data position, not those of process {rank}. Pass each "
        "process the folder it saved into; nothing was restored."
    )


def agree_on_load(error: CheckpointError | None, path: str) -> None:
    """Raise on every process if any process failed to read its part of ``path``.

    The error is a :class:`CorruptCheckpointError` on every process if any process found
    damage (so all of them may fall back to an older checkpoint together), else a
    :class:`CheckpointError`; a process re-raises its own error, the others one naming it.
    """
    entry = None if error is None else (isinstance(error, CorruptCheckpointError), str(error))
    flags = ops.gather_object([entry])
    failed = [(rank, flag) for rank, flag in enumerate(flags) if flag is not None]
    if not failed:
        return
    corrupt = any(flag[0] for _, flag in failed)
    if error is not None and isinstance(error, CorruptCheckpointError) == corrupt:
        raise error
    rank, (_, message) = failed[0]
    kind = CorruptCheckpointError if corrupt else CheckpointError
    raise kind(f"Loading {path} failed on process {rank}: {message}")
