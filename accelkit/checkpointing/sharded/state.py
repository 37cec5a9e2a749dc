"""Sharded model and optimizer state (FSDP2) through ``torch.distributed.checkpoint`` (DCP).

Inside a checkpoint folder, the state of every sharded model and of the optimizers over them
lives in one DCP checkpoint in the subfolder ``sharded/``: one file per process
(``__<rank>_0.distcp``, written by that process, in parallel) and DCP's index ``.metadata``
(written by the main process). DCP reshards on load, so a checkpoint saved by 4 processes
resumes on 2. Keys are ``model.<param>``, ``model_1.<param>``, ``optimizer.<...>`` following
:mod:`~accelkit.checkpointing.formats.layout`'s stems.

Everything goes through :mod:`~accelkit.checkpointing.storage` (a DCP ``FileSystemBase`` over
our :class:`~accelkit.checkpointing.storage.Storage`, in the lazily imported
:mod:`~accelkit.checkpointing.sharded._dcp_storage`: DCP takes seconds to import, and runs
without FSDP never pay for it), so every storage works (local, ``s3://``, ``memory://`` in one
process), files are durable before the commit, and each file's size and
checksum are computed while it streams out. :func:`save_sharded` returns the
:class:`~accelkit.checkpointing.formats.manifest.FileEntry` of every process's files
(gathered), ready for the manifest the main process writes after the barrier.

Loading never runs an unrestricted unpickler: DCP's ``.metadata`` is read with an allow-list of
DCP's own metadata classes, and non-tensor values with ``torch.load(weights_only=True)``.

Public API: :data:`SHARDED_DIRNAME`, :class:`ShardedTargets` (:func:`sharded_targets`),
:func:`save_sharded` (= :func:`clear_sharded` + :func:`write_sharded`, which an asynchronous
save calls apart), :func:`load_sharded`, :func:`has_sharded_state`,
:func:`check_load_compatible`, :func:`read_sharded_metadata`, :func:`list_sharded_tensors`,
:func:`sharded_tensor_infos` (rows for ``accelkit ckpt inspect``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.dcp_metadata import (
    DCP_METADATA_NAME,
    SHARDED_DIRNAME,
    has_sharded_state,
    read_sharded_metadata,
    sharded_tensor_infos,
)
from accelkit.checkpointing.formats.layout import model_file, object_stem
from accelkit.checkpointing.formats.manifest import FileEntry, Manifest
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.checksum import parse_checksum
from accelkit.checkpointing.storage.verified import file_checksum
from accelkit.fsdp.runtime import is_sharded
from accelkit.training.wrapping import peel

__all__ = [
    "DCP_METADATA_NAME",
    "SHARDED_DIRNAME",
    "ShardedTargets",
    "check_load_compatible",
    "clear_sharded",
    "has_sharded_state",
    "list_sharded_tensors",
    "load_sharded",
    "read_sharded_metadata",
    "save_sharded",
    "sharded_targets",
    "sharded_tensor_infos",
    "write_sharded",
]

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


# ------------------------------------------------------------------ what is sharded


@dataclass
class ShardedTargets:
    """The prepared models and optimizers whose state goes through DCP.

    Attributes:
        models: prepared model index -> sharded model.
        optimizers: prepared optimizer index -> (optimizer, the sharded model it updates).
    """

    models: dict[int, nn.Module] = field(default_factory=dict)
    optimizers: dict[int, tuple[Any, nn.Module]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.models)

    def remaining(self, objects: Any) -> Any:
        """``objects`` (a ``TrainingObjects``) without the sharded models and their optimizers.

        The rest is saved and loaded as usual; its models and optimizers are numbered among
        themselves (the same way at save and at load).
        """
        return dataclasses.replace(
            objects,
            models=[m for i, m in enumerate(objects.models) if i not in self.models],
            optimizers=[o for i, o in enumerate(objects.optimizers) if i not in self.optimizers],
        )

    def state_dict(self) -> dict[str, Any]:
        """This process's sharded state, keyed ``model``, ``model_1``, ``optimizer``, ..."""
        from accelkit.fsdp.runtime import get_optimizer_state_dict, get_state_dict

        out: dict[str, Any] = {}
        for index, model in self.models.items():
            out[_model_key(index)] = get_state_dict(model, full_state_dict=False, cpu_offload=False)
        for index, (optimizer, model) in self.optimizers.items():
            out[object_stem("optimizer", index)] = get_optimizer_state_dict(model, optimizer)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a state from :meth:`state_dict` (filled by DCP) back into models/optimizers."""
        from accelkit.fsdp.runtime import set_optimizer_state_dict, set_state_dict

        for index, model in self.models.items():
            set_state_dict(model, state[_model_key(index)], full_state_dict=False)
        for index, (optimizer, model) in self.optimizers.items():
            set_optimizer_state_dict(model, optimizer, state[object_stem("optimizer", index)])


def _model_key(index: int) -> str:
    return object_stem("model", index)


def sharded_targets(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> ShardedTargets:
    """Pick the sharded models and the optimizers over their parameters.

    Args:
        models: the prepared models, in order (their index names the keys).
        optimizers: the prepared optimizers (wrappers with ``.optimizer`` are fine).

    Raises:
        CheckpointMismatchError: if an optimizer mixes parameters of a sharded model with others.
    """
    targets = ShardedTargets()
    owners: dict[int, int] = {}
    for index, model in enumerate(models):
        inner = peel(model)[0]  # through torch.compile too
        if is_sharded(inner):
            targets.models[index] = inner
            owners.update({id(p): index for p in model.parameters()})
    for index, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        found = {owners.get(id(p)) for p in params}
        if found == {None} or not found:
            continue
        if len(found) > 1:
            raise CheckpointMismatchError(
                f"optimizer {index} updates parameters of several models (sharded models "
                f"{sorted(i for i in found if i is not None)} and/or unsharded ones); save_state "
                "of sharded state needs one optimizer per sharded model."
            )
        owner = found.pop()
        assert owner is not None
        targets.optimizers[index] = (optimizer, targets.models[owner])
    return targets


# ------------------------------------------------------------------ save


def _gather_entries(entries: list[FileEntry]) -> list[FileEntry]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return entries
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(e.path, e.size, e.checksum) for e in entries])
    out = [FileEntry(*item) for part in gathered for item in part]
    return sorted(out, key=lambda e: e.path)


def save_sharded(
    storage: Storage, folder: str, targets: ShardedTargets, gather: bool = True
) -> list[FileEntry]:
    """Write the sharded state of ``targets`` into ``<folder>/sharded`` (every process).

    A collective: every process calls it with its shards; each writes its own file in
    parallel, the main process writes ``.metadata`` after all of them.

    Args:
        storage: the storage of ``folder``.
        folder: the checkpoint folder being written (not yet committed).
        targets: from :func:`sharded_targets`.
        gather: return every process's files (an all-gather); False returns only this
            process's own (for a caller that gathers its file lists itself).

    Returns:
        The files (paths relative to ``folder``, with sizes and checksums) for the manifest.
    """
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        clear_sharded(storage, folder)
    if dist.is_initialized():
        dist.barrier()
    entries = write_sharded(storage, folder, targets.state_dict())
    return _gather_entries(entries) if gather else entries


def clear_sharded(storage: Storage, folder: str) -> None:
    """Remove ``<folder>/sharded`` left by an earlier save into ``folder`` (main process, before
    the processes meet and write): its files may be of another world size."""
    url = join(folder, SHARDED_DIRNAME)
    if storage.exists(url):
        storage.rmtree(url)


def write_sharded(
    storage: Storage, folder: str, state: dict[str, Any], process_group: Any = None
) -> list[FileEntry]:
    """Write a sharded state dict (from :meth:`ShardedTargets.state_dict`, or a host copy of
    one) into ``<folder>/sharded`` with DCP: a collective of the processes of
    ``process_group`` (default: the default group). Call :func:`clear_sharded` first.

    Returns:
        This process's files (paths relative to ``folder``, with sizes and checksums).
    """
    url = join(folder, SHARDED_DIRNAME)
    import torch.distributed.checkpoint as dcp

    from accelkit.checkpointing.sharded import _dcp_storage

    writer = _dcp_storage.Writer(storage, url)
    try:
        dcp.save(state, storage_writer=writer, process_group=process_group)
    except dcp.CheckpointException as exc:  # a BaseException, raised on every process
        raise _dcp_error(exc, "Writing", url) from exc
    prefix = url.rstrip("/") + "/"
    return [
        FileEntry(f"{SHARDED_DIRNAME}/{path[len(prefix) :]}", w.size, w.checksum)
        for path, w in writer.storage_fs.written.items()
        if path.startswith(prefix)
    ]


def _dcp_error(exc: Any, action: str, url: str, fix: str = "") -> CheckpointError:
    """DCP's ``CheckpointException`` (every process's failure, with tracebacks, and a
    ``BaseException``) as a :class:`CheckpointError` naming each failing process's error."""
    failures = sorted(getattr(exc, "failures", {}).items())
    causes = "; ".join(f"process {rank}: {type(e).__name__}: {e}" for rank, (e, _) in failures)
    return CheckpointError(f"{action} the sharded state in {url} failed on {causes or exc}{fix}")


# ------------------------------------------------------------------ load


def check_load_compatible(
    storage: Storage, folder: str, targets: ShardedTargets, model_files: Sequence[str] = ()
) -> None:
    """Refuse to load sharded state into unsharded models and the reverse.

    Args:
        storage: the storage of ``folder``.
        folder: the checkpoint folder.
        targets: the sharded models being loaded into (empty if none is sharded).
        model_files: file names of the unsharded models being loaded (``model.safetensors``..),
            used in the message.

    Raises:
        CheckpointMismatchError: naming what is missing and what to do.
    """
    sharded = has_sharded_state(storage, folder)
    if sharded and not targets:
        raise CheckpointMismatchError(
            f"{folder} holds sharded (FSDP) model state in {SHARDED_DIRNAME}/, but no prepared "
            "model is sharded. Create the Accelerator with "
            "fsdp_plugin=FullyShardedDataParallelPlugin() (or `accelkit launch --use_fsdp`) to "
            "resume it; for a single consolidated model file, load the checkpoint with FSDP and "
            "call accelerator.save_model(model, folder)."
        )
    if targets and not sharded:
        names = ", ".join(model_file(i) for i in targets.models) or ", ".join(model_files)
        raise CheckpointMismatchError(
            f"{folder} has no {SHARDED_DIRNAME}/ folder: it was saved without FSDP, but prepared "
            f"models are sharded ({names}). Resume it with an Accelerator without fsdp_plugin, "
            "or load its weights with accelkit.checkpointing.load_checkpoint_in_model before "
            "preparing the model."
        )


def _verify_checksums(storage: Storage, url: str, manifest: Manifest) -> None:
    """Check the shard files' checksums against the manifest, split among the processes."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = [e for e in manifest.files if e.path.startswith(f"{SHARDED_DIRNAME}/")][rank::world]
    bad: list[str] = []
    for entry in mine:
        algorithm, _ = parse_checksum(entry.checksum)
        _, actual = file_checksum(storage, join(url, entry.path.split("/", 1)[1]), algorithm)
        if actual != entry.checksum:
            bad.append(f"{entry.path} (checksum {actual}, manifest says {entry.checksum})")
    if world > 1:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, bad)
        bad = [item for part in parts for item in part]
    if bad:
        raise CorruptCheckpointError(
            f"The sharded state in {url} is corrupt: {', '.join(bad)}. Nothing was loaded; "
            "load an earlier checkpoint (`accelkit ckpt verify` checks them)."
        )


def _check_files(storage: Storage, url: str, metadata: Any, manifest: Manifest | None) -> None:
    """Every shard file DCP's index refers to (and the manifest lists) exists, full size."""
    needed = {info.relative_path for info in metadata.storage_data.values()}
    listed = {
        e.path.split("/", 1)[1]: e.size
        for e in (manifest.files if manifest is not None else [])
        if e.path.startswith(f"{SHARDED_DIRNAME}/")
    }
    present = storage.walk_files(url)
    missing = [
        name
        for name in sorted(needed | set(listed))
        if name not in present or (name in listed and listed[name] != present[name])
    ]
    if missing:
        owners = [
            f"{name} (rank {m.group(1)})" if (m := _RANK_FILE.match(name)) else name
            for name in missing
        ]
        raise CorruptCheckpointError(
            f"The sharded state in {url} is incomplete: {', '.join(owners)} "
            f"{'is' if len(owners) == 1 else 'are'} missing or truncated. Every process writes "
            f"its own shard file; restore the file(s), or load an earlier checkpoint "
            f"(see `accelkit ckpt ls` / `accelkit ckpt verify`)."
        )


def _check_keys(url: str, metadata: Any, state: dict[str, Any]) -> None:
    stored = set(metadata.state_dict_metadata)
    for key, value in state.items():
        if not key.startswith("model"):
            continue
        wanted = {f"{key}.{name}" for name in value}
        have = {k for k in stored if k.startswith(f"{key}.")}
        missing, unexpected = sorted(wanted - have), sorted(have - wanted)
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"The sharded state in {url} does not fit prepared model {key!r}: missing keys "
                f"{missing[:10]}{'...' if len(missing) > 10 else ''}, unexpected keys "
                f"{unexpected[:10]}{'...' if len(unexpected) > 10 else ''}. Load it into the "
                "model architecture it was saved from."
            )
    absent = sorted(k for k in state if not any(s.startswith(f"{k}.") for s in stored))
    if absent:
        raise CheckpointMismatchError(
            f"The sharded state in {url} has no {', '.join(absent)}: it was saved with other "
            "prepared objects. Prepare the same models and optimizers, in the same order."
        )


def load_sharded(
    storage: Storage,
    folder: str,
    targets: ShardedTargets,
    manifest: Manifest | None = None,
    verify: bool = False,
) -> None:
    """Load ``<folder>/sharded`` into ``targets`` (every process; resharding as needed).

    Args:
        storage: the storage of ``folder``.
        folder: a committed checkpoint folder.
        targets: from :func:`sharded_targets`.
        manifest: the checkpoint's manifest; every shard file it lists must exist with its
            size before anything is loaded.
        verify: also check the shard files' checksums against ``manifest`` first (each
            process reads a share of the files). DCP loads into the live parameters, so this
            is what makes a damaged shard fail before any model or optimizer changes.

    Raises:
        CheckpointMismatchError: sharded state loaded without FSDP (or the reverse), or keys
            that do not fit the models.
        CorruptCheckpointError: a missing ``.metadata`` or shard file.
    """
    check_load_compatible(storage, folder, targets)
    url = join(folder, SHARDED_DIRNAME)
    metadata = read_sharded_metadata(storage, url)
    _check_files(storage, url, metadata, manifest)
    if verify and manifest is not None:
        _verify_checksums(storage, url, manifest)
    state = targets.state_dict()
    _check_keys(url, metadata, state)
    import torch.distributed.checkpoint as dcp

    from accelkit.checkpointing.sharded import _dcp_storage

    reader = _dcp_storage.Reader(storage, url)
    try:
        dcp.load(state, storage_reader=reader, planner=_dcp_storage.SafeLoadPlanner())
    except dcp.CheckpointException as exc:
        fix = ". Load an earlier checkpoint (`accelkit ckpt verify` checks them)."
        raise _dcp_error(exc, "Reading", url, fix) from exc
    targets.load_state_dict(state)


def list_sharded_tensors(storage: Storage, folder: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, full shape)`` of every tensor of a checkpoint's sharded state.

    For ``accelkit ckpt inspect``: reads only ``.metadata``, no tensor data.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_sharded_metadata(storage, join(folder, SHARDED_DIRNAME))
    out = []
    for name, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = str(item.properties.dtype).removeprefix("torch.")
            out.append((name, dtype, tuple(item.size)))
    return out
