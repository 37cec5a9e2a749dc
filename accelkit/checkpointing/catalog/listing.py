"""Finding checkpoints: list a checkpoints folder, tell each one's state, pick the latest.

States: ``committed`` (its manifest parses and every listed file is present with the recorded
size), ``incomplete`` (no manifest, but accelkit's save marker ``.accelkit-save.json``, or
nothing at all: a save in flight or one that crashed; the only state besides a committed one
that accelkit ever deletes), ``corrupt`` (a manifest that does not parse, a listed file missing
or of the wrong size, or a symbolic link anywhere inside), ``accelerate`` (no manifest and no
marker, but the files of a Hugging Face accelerate checkpoint) and ``foreign`` (no manifest, no
marker: a folder accelkit did not write). Checksums are not read here (see
:func:`~accelkit.checkpointing.formats.manifest.verify_files`). A folder that is neither named
``checkpoint_<n>`` nor holds a manifest (for example ``checkpoints/best`` made by the user) is
not a checkpoint and is never listed, unless it holds Hugging Face accelerate's files (its
examples name their folders ``step_<n>`` and ``epoch_<n>``): those are listed as
``accelerate``. Every folder is read through
:func:`~accelkit.checkpointing.storage.confined.confine`: no link inside it is followed.

Public API:

- :class:`CheckpointInfo` -- ``name``, ``path``, ``state``, ``iteration``, ``step``,
  ``created``, ``size_bytes``, ``files``, ``metrics``, ``manifest``, ``error``, ``is_automatic``.
- :func:`inspect_folder(storage, path) <inspect_folder>` -- the :class:`CheckpointInfo` of one
  folder (state ``incomplete`` if it has no manifest).
- :func:`list_checkpoints(storage, root) <list_checkpoints>` -- every checkpoint directly under
  ``root``, oldest first (an empty list if ``root`` does not exist).
- :func:`committed_automatic(infos) <committed_automatic>` -- the committed
  ``checkpoint_<n>`` ones: what training retention and ``load_state()`` consider.
- :func:`loadable_automatic(infos) <loadable_automatic>` -- the committed and the
  ``accelerate`` ``checkpoint_<n>`` ones: what ``load_state()`` with no argument considers
  (newest by number, as Accelerate does; an Accelerate folder is read safely, never pruned).
- :func:`latest_checkpoint(storage, root) <latest_checkpoint>` -- the newest committed
  ``checkpoint_<n>``, or ``None``.
- :func:`next_iteration(infos) <next_iteration>` -- 1 + the highest ``checkpoint_<n>`` number
  present in any state (so a new save never reuses a folder name).
- :func:`resolve_checkpoints_root(storage, path) <resolve_checkpoints_root>` -- accept a
  project dir or its ``checkpoints`` folder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from accelkit._text import at_most
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.layout import (
    CHECKPOINTS_DIRNAME,
    MANIFEST_NAME,
    SAVE_MARKER_NAME,
    looks_like_accelerate,
    parse_checkpoint_name,
)
from accelkit.checkpointing.formats.manifest import (
    Manifest,
    ManifestError,
    read_manifest,
    verify_files,
)
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.confined import confine

__all__ = [
    "ACCELERATE",
    "COMMITTED",
    "CORRUPT",
    "FOREIGN",
    "INCOMPLETE",
    "CheckpointInfo",
    "committed_automatic",
    "holds_accelerate_files",
    "inspect_folder",
    "latest_checkpoint",
    "list_checkpoints",
    "loadable_automatic",
    "next_iteration",
    "resolve_checkpoints_root",
    "unmanifested_state",
]

COMMITTED = "committed"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
ACCELERATE = "accelerate"
FOREIGN = "foreign"
NOT_OURS = (ACCELERATE, FOREIGN)
_NOT_OURS_DETAIL = {
    ACCELERATE: (
        "not an accelkit checkpoint but one written by Hugging Face accelerate (its files are "
        "accelerate's: {files}); load_state reads it as it is, `accelkit ckpt import` "
        "converts it"
    ),
    FOREIGN: (
        "a foreign folder, not an accelkit checkpoint: it has no accelkit.json and no "
        ".accelkit-save.json (the marker every accelkit save writes first), so accelkit did not "
        "write it (files: {files})"
    ),
}


@dataclass(frozen=True)
class CheckpointInfo:
    """What is known about one checkpoint folder without reading its tensors.

    Attributes:
        name: the folder's name (``checkpoint_3``).
        path: its full path or URL.
        state: ``"committed"``, ``"incomplete"``, ``"corrupt"``, ``"accelerate"`` or
            ``"foreign"`` (see the module docstring).
        iteration: from the manifest, else from a ``checkpoint_<n>`` name, else ``None``.
        step: optimizer steps at save time (``None`` without a manifest).
        created: commit time (UNIX seconds; ``0.0`` without a manifest).
        size_bytes: total size of the files present in the folder.
        files: number of files present in the folder (the manifest included).
        metrics: metrics saved with it.
        manifest: the parsed manifest, if any.
        error: why it is corrupt, or what an ``accelerate``/``foreign`` folder is.
        is_automatic: whether the name is ``checkpoint_<n>``.
    """

    name: str
    path: str
    state: str
    iteration: int | None
    step: int | None
    created: float
    size_bytes: int
    files: int
    metrics: dict[str, float] = field(default_factory=dict)
    manifest: Manifest | None = None
    error: str | None = None
    is_automatic: bool = False


def inspect_folder(storage: Storage, path: str, name: str | None = None) -> CheckpointInfo:
    """Describe the checkpoint folder at ``path`` (sizes checked, checksums not)."""
    name = name or path.rstrip("/").rsplit("/", 1)[-1]
    auto_iteration = parse_checkpoint_name(name)
    storage = confine(storage, path)
    listing: dict[str, int] = {}

    def info(
        state: str, manifest: Manifest | None = None, error: str | None = None
    ) -> CheckpointInfo:
        # A checkpoint_<n> folder's number is its iteration, whatever its manifest claims: a
        # copied or crafted manifest must not steer load_state(), numbering or retention.
        iteration = auto_iteration
        if iteration is None and manifest is not None:
            iteration = manifest.iteration
        return CheckpointInfo(
            name=name,
            path=path,
            state=state,
            iteration=iteration,
            step=None if manifest is None else manifest.step,
            created=0.0 if manifest is None else manifest.created,
            size_bytes=sum(listing.values()),
            files=len(listing),
            metrics={} if manifest is None else dict(manifest.metrics),
            manifest=manifest,
            error=error,
            is_automatic=auto_iteration is not None,
        )

    try:
        listing = storage.walk_files(path)
    except (FileNotFoundError, NotADirectoryError):
        listing = {}
    except CorruptCheckpointError as exc:  # a symbolic link inside, or the folder is one
        return info(CORRUPT, error=str(exc))
    try:
        manifest = read_manifest(storage, path) if MANIFEST_NAME in listing else None
    except ManifestError as exc:
        return info(CORRUPT, error=str(exc))
    if manifest is None:
        state = unmanifested_state(listing)
        detail = _NOT_OURS_DETAIL.get(state)
        shown = ", ".join(sorted(listing)[:5]) + (", ..." if len(listing) > 5 else "")
        return info(state, error=None if detail is None else detail.format(files=shown))
    problems = verify_files(storage, path, manifest, checksums=False, sizes=listing)
    if problems:
        # A crafted manifest may list a million missing files: the reason stays a few of them.
        return info(CORRUPT, manifest, "; ".join(at_most([str(p) for p in problems], 5)))
    return info(COMMITTED, manifest)


def unmanifested_state(names: Iterable[str]) -> str:
    """The state of a folder without a manifest holding the files ``names`` (relative paths):
    ``incomplete`` if accelkit's save marker is there or it is empty, ``accelerate`` if the
    files are Hugging Face accelerate's, else ``foreign``."""
    names = list(names)
    if not names or SAVE_MARKER_NAME in names:
        return INCOMPLETE
    return ACCELERATE if looks_like_accelerate(names) else FOREIGN


def _sort_key(info: CheckpointInfo) -> tuple[int, float, int, str]:
    # Folders without an iteration (Accelerate's step_50, step_100) by the number in their name.
    number = re.search(r"(\d+)$", info.name)
    return (
        -1 if info.iteration is None else info.iteration,
        info.created,
        int(number.group(1)[:18]) if number else -1,
        info.name,
    )


def holds_accelerate_files(storage: Storage, path: str) -> bool:
    """Whether the folder ``path`` holds files of a Hugging Face accelerate ``save_state``
    directly (Accelerate's own examples name them ``step_<n>`` and ``epoch_<n>``; any name
    counts). One listing of the folder; an unreadable one does not."""
    try:
        entries = storage.listdir(path)
    except OSError:
        return False
    return looks_like_accelerate(e.name for e in entries if not e.is_dir and not e.is_symlink)


def list_checkpoints(storage: Storage, root: str) -> list[CheckpointInfo]:
    """Every checkpoint directly under ``root``, oldest first.

    Lists ``checkpoint_<n>`` folders in any state, other folders that hold a manifest, and
    folders of any name that hold Hugging Face accelerate's files (``step_<n>``, ``epoch_<n>``);
    anything else (``best/``, ``logs/``, loose files) is ignored.
    """
    try:
        entries = storage.listdir(root)
    except FileNotFoundError:
        return []
    infos = []
    for entry in entries:
        if not entry.is_dir or entry.is_symlink:
            continue
        path = join(root, entry.name)
        if (
            parse_checkpoint_name(entry.name) is None
            and not storage.exists(join(path, MANIFEST_NAME))
            and not holds_accelerate_files(storage, path)
        ):
            continue
        infos.append(inspect_folder(storage, path, entry.name))
    return sorted(infos, key=_sort_key)


def committed_automatic(infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """The committed ``checkpoint_<n>`` checkpoints, oldest first."""
    return sorted((i for i in infos if i.state == COMMITTED and i.is_automatic), key=_sort_key)


def loadable_automatic(infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """The ``checkpoint_<n>`` checkpoints ``load_state()`` may restore, oldest first:
    committed ones and those Hugging Face accelerate wrote (state ``accelerate``)."""
    return sorted(
        (i for i in infos if i.state in (COMMITTED, ACCELERATE) and i.is_automatic), key=_sort_key
    )


def latest_checkpoint(storage: Storage, root: str) -> CheckpointInfo | None:
    """The newest committed ``checkpoint_<n>`` under ``root``, or ``None``."""
    committed = committed_automatic(list_checkpoints(storage, root))
    return committed[-1] if committed else None


def next_iteration(infos: Iterable[CheckpointInfo]) -> int:
    """1 + the highest ``checkpoint_<n>`` number among ``infos`` (any state); 0 if none."""
    numbers = [parse_checkpoint_name(i.name) for i in infos]
    present = [n for n in numbers if n is not None]
    return max(present) + 1 if present else 0


def resolve_checkpoints_root(storage: Storage, path: str) -> str:
    """``path/checkpoints`` if ``path`` is a project dir that has one, else ``path``."""
    candidate = join(path, CHECKPOINTS_DIRNAME)
    if storage.isdir(candidate):
        return candidate
    return path
