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
(:mod:`~accelkit.checkpointing.protocol`); every process decides from the same list, so all
of them go on the same way or raise the same error:

- one folder for all: a checkpoint shared by every process (the normal case, unchanged);
- a different folder on each process: a per-process checkpoint in each;
- anything else is refused with a :class:`~accelkit.checkpointing.errors.CheckpointError`
  naming the folders: some processes sharing a folder while others do not, automatically named
  folders that differ (``project_dir`` must be the same everywhere), and sharded (FSDP) state,
  which ``torch.distributed.checkpoint`` writes with every process into one shared folder.
  The refusal comes after the main process prepared its own folder, so, as after any failed
  save into an explicit folder, a checkpoint that was there before is no longer committed.

Loading (:func:`check_loadable_here`): a per-process checkpoint is restored by the process that
wrote it, with any process count (``load_state`` warns when the count differs, as for any
checkpoint); another process is refused, since the random states and data positions in it are
the writer's.

Public API: :func:`folder_key`, :func:`folders_per_process`, :func:`check_owner`,
:func:`check_loadable_here`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from accelkit.checkpointing.catalog import CheckpointInfo
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.loading import agree_on_load, check_loadable
from accelkit.checkpointing.storage import Storage

__all__ = ["check_loadable_here", "check_owner", "folder_key", "folders_per_process"]

_SHOWN = 4  # processes named in a message; the rest are counted


def folder_key(target: str) -> str:
    """How ``target`` is compared with the other processes' folders: a URL without its
    trailing ``/``, a local path made absolute (by this process) and normalised."""
    if "://" in target:
        return target.rstrip("/")
    return os.path.normpath(os.path.abspath(target))


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


def folders_per_process(folders: Sequence[str], automatic: bool, sharded: bool) -> bool:
    """Whether each process saves a checkpoint of its own into its own folder.

    Args:
        folders: every process's :func:`folder_key`, by rank.
        automatic: the folders are automatically named ``checkpoint_<n>`` under project_dir.
        sharded: the save writes sharded (FSDP) state.

    Returns:
        ``False`` when every process gave the same folder (one shared checkpoint), ``True``
        when each gave a different one.

    Raises:
        CheckpointError: naming the folders, when they differ and either some processes share
            one, they are automatically named, or the state is sharded.
    """
    if len(set(folders)) == 1:
        return False
    if automatic:
        raise CheckpointError(
            f"The automatically named checkpoint folder differs between processes "
            f"({_by_process(folders)}): project_dir must name the same folder on every "
            "process. Pass the same project_dir everywhere, or give save_state an output_dir."
        )
    if len(set(folders)) != len(folders):
        raise CheckpointError(
            f"save_state got one folder from several processes and other folders from the "
            f"rest ({_by_folder(folders)}; {_by_process(folders)}). Pass the same output_dir "
            "on every process (one shared checkpoint), or a different one on each (a "
            "checkpoint per process)."
        )
    if sharded:
        raise CheckpointError(
            f"save_state got a different folder on each process ({_by_process(folders)}), but "
            "sharded (FSDP) state is written by all processes together into one folder "
            "(torch.distributed.checkpoint). Pass the same output_dir on every process, on a "
            "file system or bucket they all reach."
        )
    return True


def check_owner(manifest: Manifest, path: str, rank: int) -> None:
    """Refuse a per-process checkpoint that another process wrote.

    Raises:
        CheckpointError: ``path`` is the per-process checkpoint of a process other than
            ``rank``.
    """
    writer = manifest.process_index
    if writer is None or writer == rank:
        return
    raise CheckpointError(
        f"{path} is the checkpoint that process {writer} saved into a folder of its own (each "
        f"of the {manifest.world_size} processes saved into its own folder): it holds process "
        f"{writer}'s random states and data position, not those of process {rank}. Pass each "
        "process the folder it saved into; nothing was restored."
    )


def check_loadable_here(storage: Storage, path: str, rank: int) -> CheckpointInfo:
    """:func:`~accelkit.checkpointing.loading.check_loadable`, then :func:`check_owner`;
    every process learns whether any of them cannot load its folder (the processes may load
    different folders), so all of them raise or none does.

    Raises:
        CheckpointError: as those two, on this process or (naming it) on another one.
    """
    info: CheckpointInfo | None = None
    error: CheckpointError | None = None
    try:
        info = check_loadable(storage, path)
        if info.manifest is not None:
            check_owner(info.manifest, path, rank)
    except CheckpointError as exc:
        error = exc
    agree_on_load(error, path)
    assert info is not None
    return info
