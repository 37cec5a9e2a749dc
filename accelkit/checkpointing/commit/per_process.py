"""Per-process checkpoints: the processes of one save pass different folders to ``save_state``.

A script may give each process a folder of its own: a path naming the process (on a local
disk per machine), or a ``tempfile.TemporaryDirectory()`` per process (as Accelerate's own test
scripts do). The same path on every machine is one folder to accelkit: a multi-machine save
into it needs storage every machine sees (a shared filesystem, S3). One
manifest written by the main process cannot describe files spread over several folders, so
accelkit then makes every folder a complete checkpoint of its own: each process writes the
replicated state (model weights, optimizers, schedulers, grad scaler, dataloader positions,
registered objects) and its own random states into its folder and commits it with its own
``accelkit.json``, which lists just that folder's files and records the writer as
``process_index``. ``load_state(that folder)`` on that process restores all of it.

The processes exchange their folders in the prepare phase of the commit protocol
(:mod:`~accelkit.checkpointing.commit.protocol`); every process decides from the same list, so all
of them go on the same way or raise the same error:

- one folder for all: a checkpoint shared by every process (the normal case, unchanged);
- a different folder on each process: a per-process checkpoint in each;
- anything else is refused with a :class:`~accelkit.checkpointing.errors.CheckpointError`
  naming the folders: some processes sharing a folder while others do not, automatically named
  folders that differ (``project_dir`` must be the same everywhere), sharded (FSDP) state,
  which ``torch.distributed.checkpoint`` writes with every process into one shared folder,
  folders that *alias* (different names for one real folder: a symbolic link, a bind mount)
  and folders that *nest* (``a`` and ``a/sub``): each process would remove the other's files
  as left over from an earlier save and both would report success.

Folders are compared after resolving them (:func:`resolve_folder`): a local path made
absolute, its symbolic links resolved, and the identity (device, inode) of its nearest
existing folder taken; a URL normalised (``s3://b//run/./x/`` is ``s3://b/run/x``). The
refusal comes before any process writes anything (the main process prepares its folder only
after the processes agreed).

Loading: a per-process checkpoint is restored by the process that wrote it, with any process
count; another process is refused (:func:`~accelkit.checkpointing.restore.loading.check_owner`,
a check of the load sequence), since the random states and data positions in it are the
writer's.

Public API: :class:`Folder`, :func:`resolve_folder`, :func:`folder_key`,
:func:`folders_per_process`.
"""

from __future__ import annotations

import os
import posixpath
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from accelkit.checkpointing.errors import CheckpointPathError

__all__ = [
    "Folder",
    "folder_key",
    "folders_per_process",
    "resolve_folder",
]

_SHOWN = 4  # processes named in a message; the rest are counted


@dataclass(frozen=True)
class Folder:
    """One process's save folder, as the processes compare it.

    Attributes:
        name: as given, made absolute and normalised (a URL: normalised).
        real: ``name`` with its symbolic links resolved (a URL: ``name``).
        identity: ``(host, device, inode, rest)`` of the nearest existing folder at or above
            ``real`` and the path below it; two names with one identity are one folder even
            where the paths differ (a bind mount, a case-insensitive disk). ``None`` for a URL.
    """

    name: str
    real: str
    identity: tuple[str, int, int, str] | None = None


def _normalise_url(target: str) -> str:
    protocol, _, rest = target.partition("://")
    path = posixpath.normpath(rest) if rest else rest
    return f"{protocol.lower()}://{'' if path == '.' else path}"


def _identity(real: str) -> tuple[str, int, int, str] | None:
    here, rest = real, ""
    while True:
        try:
            st = os.stat(here)
        except OSError:
            parent = os.path.dirname(here)
            if parent == here:
                return None
            rest = posixpath.join(os.path.basename(here), rest) if rest else os.path.basename(here)
            here = parent
            continue
        return (socket.gethostname(), st.st_dev, st.st_ino, rest)


def resolve_folder(target: str) -> Folder:
    """``target`` as it is compared with the other processes' folders (see :class:`Folder`).

    A ``file://`` URL is the local path it names.
    """
    if target.startswith("file://"):
        target = target[len("file://") :] or "/"
    if "://" in target:
        url = _normalise_url(target)
        return Folder(url, url)
    name = os.path.normpath(os.path.abspath(target))
    real = os.path.realpath(name)
    return Folder(name, real, _identity(real))


def folder_key(target: str) -> str:
    """How ``target`` is compared with the other processes' folders: a URL normalised, a local
    path made absolute (by this process), normalised and with its links resolved."""
    return resolve_folder(target).real


def _inside(inner: str, outer: str) -> bool:
    return inner != outer and inner.startswith(outer.rstrip("/") + "/")


def _aliases(folders: Sequence[Folder]) -> str | None:
    """A description of two processes whose different names are one folder, or ``None``."""
    for i, a in enumerate(folders):
        for j in range(i + 1, len(folders)):
            b = folders[j]
            same = a.real == b.real or (a.identity is not None and a.identity == b.identity)
            if same and a.name != b.name:
                return (
                    f"process {i}'s {a.name} and process {j}'s {b.name} are one folder "
                    f"({a.real}{'' if a.real == b.real else ' = ' + b.real})"
                )
    return None


def _nested(folders: Sequence[Folder]) -> str | None:
    """A description of two processes of which one's folder is inside the other's."""
    for i, a in enumerate(folders):
        for j, b in enumerate(folders):
            if i != j and _inside(a.real, b.real):
                return f"process {i}'s {a.name} is inside process {j}'s {b.name}"
    return None


def _by_process(folders: Sequence[str]) -> str:
    shown = [f"process {rank}: {folder}" for rank, folder in enumerate(folders[:_SHOWN])]
    more = f", ... ({len(folders)} processes)" if len(folders) > _SHOWN else ""
    return ", ".join(shown) + more


def _by_folder(folders: Sequence[str]) -> str:
    ranks: dict[str, list[int]] = {}
    for rank, folder in enumerate(folders):
        ranks.setdefault(folder, []).append(rank)
    shared = [(f, r) for f, r in ranks.items() if len(r) > 1][:_SHOWN]
    return "; ".join(f"{folder}: processes {', '.join(map(str, r))}" for folder, r in shared)


def folders_per_process(folders: Sequence[Folder], automatic: bool, sharded: bool) -> bool:
    """Whether each process saves a checkpoint of its own into its own folder.

    Args:
        folders: every process's :func:`resolve_folder`, by rank.
        automatic: the folders are automatically named ``checkpoint_<n>`` under project_dir.
        sharded: the save writes sharded (FSDP) state.

    Returns:
        ``False`` when every process gave the same folder (one shared checkpoint), ``True``
        when each gave a different one.

    Raises:
        CheckpointError: naming the folders, when they differ and either some processes share
            one, two are one real folder under different names, one is inside another, they
            are automatically named, or the state is sharded.
    """
    alias = _aliases(folders)
    if alias is not None:
        raise CheckpointPathError(
            f"save_state got folders that are different names for one folder: {alias}. Each "
            "process would remove the other's files as left over from an earlier save. Pass "
            "the same output_dir on every process (one shared checkpoint), or folders that are "
            "really different (no link or mount between them); nothing was written."
        )
    names = [f.real for f in folders]
    if len(set(names)) == 1:
        return False
    shown = [f.name for f in folders]
    if automatic:
        raise CheckpointPathError(
            f"The automatically named checkpoint folder differs between processes "
            f"({_by_process(shown)}): project_dir must name the same folder on every "
            "process. Pass the same project_dir everywhere, or give save_state an output_dir."
        )
    if len(set(names)) != len(names):
        raise CheckpointPathError(
            f"save_state got one folder from several processes and other folders from the "
            f"rest ({_by_folder(shown)}; {_by_process(shown)}). Pass the same output_dir "
            "on every process (one shared checkpoint), or a different one on each (a "
            "checkpoint per process)."
        )
    nested = _nested(folders)
    if nested is not None:
        raise CheckpointPathError(
            f"save_state got a folder inside another process's folder: {nested} "
            f"({_by_process(shown)}). A checkpoint folder holds only its own files: the "
            "outer save would list or remove the inner one's. Pass folders side by side "
            "(e.g. ckpt/rank0 and ckpt/rank1); nothing was written."
        )
    if sharded:
        raise CheckpointPathError(
            f"save_state got a different folder on each process ({_by_process(shown)}), but "
            "sharded (FSDP) state is written by all processes together into one folder "
            "(torch.distributed.checkpoint). Pass the same output_dir on every process, on a "
            "file system or bucket they all reach."
        )
    return True
