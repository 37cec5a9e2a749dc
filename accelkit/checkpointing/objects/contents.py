"""What is inside one training checkpoint, and how each object is written and restored.

The commit protocol (who writes when, the manifest, retention) lives in
:mod:`~accelkit.checkpointing.manager`; this module only knows the files:

==========================  =============================================================
file                        holds
==========================  =============================================================
``model.safetensors``,      one per model (or shards + ``model.safetensors.index.json``)
``model_1.safetensors``...
``optimizer[_i].*``         each optimizer's ``state_dict()``
``scheduler[_i].*``         each scheduler's ``state_dict()``
``scaler.*``                the grad scaler's ``state_dict()``
``dataloader_<i>.*``        each dataloader's position (``state_dict()``)
``custom_checkpoint_<i>.*`` each object given to ``register_for_checkpointing``
``random_states_<rank>.*``  each process's Python/NumPy/torch/CUDA generator states
``resume_fingerprint_<r>``  each process's record of what its next steps consume
                            (:mod:`.fingerprint`; older checkpoints have none)
==========================  =============================================================

Public API:

- :class:`TrainingObjects` -- the live objects to save or restore.
- :func:`unwrap_model` -- the module inside ``DistributedDataParallel``/``torch.compile``.
- :func:`snapshot_contents` -> :class:`Snapshot` (this process's share, as ``(stem, state)``
  pairs) and :func:`write_snapshot`; :func:`write_contents` does both.
- :func:`read_contents(...) <read_contents>` -- read and check every file this process needs,
  changing nothing; returns a :class:`LoadedContents`.
- :func:`apply_contents(loaded, objects) <apply_contents>` -- restore the objects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError
from accelkit.checkpointing.formats.layout import (
    KINDS,
    STRUCTURE_SUFFIX,
    custom_stem,
    dataloader_stem,
    model_file,
    object_stem,
    random_states_stem,
    resume_fingerprint_stem,
)
from accelkit.checkpointing.formats.manifest import FileEntry, Manifest
from accelkit.checkpointing.formats.model_io import (
    check_model_keys,
    read_model_files,
    write_model_files,
)
from accelkit.checkpointing.formats.state_io import read_state, write_state
from accelkit.checkpointing.objects.fingerprint import Fingerprint, check_fingerprint
from accelkit.checkpointing.objects.rng import capture_rng_state, check_rng_state, restore_rng_state
from accelkit.checkpointing.storage import Storage, WrittenFile, join
from accelkit.runtime.random import set_seed
from accelkit.training.wrapping import peel

__all__ = [
    "LoadedContents",
    "Snapshot",
    "TrainingObjects",
    "apply_contents",
    "read_contents",
    "snapshot_contents",
    "unwrap_model",
    "write_contents",
    "write_snapshot",
]

logger = logging.getLogger(__name__)

_COUNTED = ("optimizer", "scheduler", "dataloader", "custom")
# The files load_state reads to find how many objects of each kind a checkpoint holds.
_PATTERNS = {
    "model": KINDS["model"].regex(shards=False),
    **{kind: KINDS[kind].regex((STRUCTURE_SUFFIX,)) for kind in _COUNTED},
}


@dataclass
class TrainingObjects:
    """The live objects a checkpoint saves and restores.

    Attributes:
        models: prepared models (possibly wrapped in DDP); their unwrapped weights are saved.
        optimizers / schedulers: objects with ``state_dict``/``load_state_dict``.
        dataloaders: prepared dataloaders; those with ``state_dict`` have their position saved.
        scaler: a ``torch.amp.GradScaler`` or ``None``.
        custom: objects given to ``register_for_checkpointing``.
        model_load_kwargs: keyword arguments for each model's ``load_state_dict`` when
            loading (``strict=False``: keys the checkpoint or the model lacks are left out,
            shapes are still checked; ``assign``).
        fingerprint: when saving, this process's resume fingerprint (written as
            ``resume_fingerprint_<rank>``; see :mod:`.fingerprint`), or ``None`` for none.
    """

    models: Sequence[torch.nn.Module] = ()
    optimizers: Sequence[Any] = ()
    schedulers: Sequence[Any] = ()
    dataloaders: Sequence[Any] = ()
    scaler: Any = None
    custom: Sequence[Any] = ()
    model_load_kwargs: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: Fingerprint | None = None


@dataclass
class LoadedContents:
    """Everything read from a checkpoint, checked, not yet applied."""

    models: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = field(default_factory=list)
    states: list[tuple[Any, Any, str]] = field(default_factory=list)  # (object, state, file)
    rng: Any = None
    rng_file: str = ""
    # Set when this process has no saved random states (the run has more processes than the
    # one that saved): the generators are seeded with it instead, the same way every time.
    rng_fallback_seed: int | None = None
    # This process's resume fingerprint; None for a checkpoint saved without one.
    fingerprint: Fingerprint | None = None


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``DistributedDataParallel``/``DataParallel`` and ``torch.compile``
    (whose ``state_dict`` keys a checkpoint holds); see :func:`accelkit.training.wrapping.peel`."""
    return peel(model)[0]


def model_stem(index: int) -> str:
    """``model``, ``model_1``, ..."""
    return object_stem("model", index)


def _stateful_loaders(dataloaders: Sequence[Any]) -> list[tuple[int, Any]]:
    return [(i, dl) for i, dl in enumerate(dataloaders) if hasattr(dl, "state_dict")]


@dataclass
class Snapshot:
    """What one process writes, captured from the live objects: ``(stem, state)`` pairs.

    Attributes:
        models: ``(stem, state_dict)`` per model file (``model``, ``model_1``...).
        states: ``(stem, state)`` per object state (optimizers, schedulers, scaler,
            dataloaders, registered objects, this process's RNG states).

    The tensors are the live ones (no copy); a caller that keeps training while the snapshot
    is written must copy them first.
    """

    models: list[tuple[str, Mapping[str, torch.Tensor]]] = field(default_factory=list)
    states: list[tuple[str, Any]] = field(default_factory=list)


def snapshot_contents(
    objects: TrainingObjects,
    weights: Sequence[Mapping[str, torch.Tensor]],
    rank: int,
    is_main: bool,
) -> Snapshot:
    """Capture this process's share: the shared states on the main process, RNG on all.

    Args:
        weights: the models' state dicts as left by the save pre-hooks (one file per entry).
    """
    snap = Snapshot()
    if is_main:
        snap.models = [(model_stem(i), sd) for i, sd in enumerate(weights)]
        for kind, items in (("optimizer", objects.optimizers), ("scheduler", objects.schedulers)):
            snap.states += [(object_stem(kind, i), o.state_dict()) for i, o in enumerate(items)]
        if objects.scaler is not None:
            snap.states.append((object_stem("scaler"), objects.scaler.state_dict()))
        for i, loader in _stateful_loaders(objects.dataloaders):
            snap.states.append((dataloader_stem(i), loader.state_dict()))
        snap.states += [(custom_stem(i), o.state_dict()) for i, o in enumerate(objects.custom)]
    snap.states.append((random_states_stem(rank), capture_rng_state()))
    if objects.fingerprint is not None:
        snap.states.append((resume_fingerprint_stem(rank), dict(objects.fingerprint)))
    return snap


def write_snapshot(
    storage: Storage, folder: str, snapshot: Snapshot, max_shard_size: int | str = "10GB"
) -> dict[str, WrittenFile]:
    """Write a :class:`Snapshot` into ``folder``; returns relative file name -> written file."""
    written: dict[str, WrittenFile] = {}
    for stem, state_dict in snapshot.models:
        written.update(write_model_files(storage, folder, state_dict, stem, max_shard_size))
    for stem, state in snapshot.states:
        written.update(write_state(storage, folder, stem, state))
    return written


def write_contents(
    storage: Storage,
    folder: str,
    objects: TrainingObjects,
    weights: Sequence[Mapping[str, torch.Tensor]],
    rank: int,
    is_main: bool,
    max_shard_size: int | str = "10GB",
) -> dict[str, WrittenFile]:
    """:func:`snapshot_contents` then :func:`write_snapshot`."""
    snapshot = snapshot_contents(objects, weights, rank, is_main)
    return write_snapshot(storage, folder, snapshot, max_shard_size)


def _indexes(names: Sequence[str], kind: str) -> list[int]:
    found = set()
    for name in names:
        match = _PATTERNS[kind].match(name)
        if match:
            found.add(int(match.group(1) or 0))
    return sorted(found)


def _check_count(folder: str, kind: str, saved: list[int], wanted: list[int], fix: str) -> None:
    if saved != wanted:
        raise CheckpointMismatchError(
            f"{folder} holds {len(saved)} {kind} state(s) (indexes {saved}) but {len(wanted)} "
            f"{kind}(s) are to be restored (indexes {wanted}). {fix}"
        )


def _check_optimizer(optimizer: Any, state: Any, source: str) -> None:
    try:
        saved = [len(g["params"]) for g in state["param_groups"]]
        current = [len(g["params"]) for g in optimizer.state_dict()["param_groups"]]
    except (TypeError, KeyError):
        return  # not a torch-style optimizer state: its own load_state_dict judges it
    if saved != current:
        raise CheckpointMismatchError(
            f"{source}: the optimizer was saved with parameter groups of sizes {saved} but the "
            f"current one has {current}. Build the optimizer over the same parameters as when "
            "it was saved."
        )
    _check_state_tensors(optimizer, state, source)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point or dtype.is_complex else "int"


def _check_state_tensors(optimizer: Any, state: Any, source: str) -> None:
    """A stored per-parameter state tensor shaped like its parameter (Adam's moments, SGD's
    momentum) must be of the parameter's kind: torch casts float to float on load, but integer
    bytes relabelled from floats would be kept as integers and break the next step."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    ids = [i for group in state["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params))
    stored = state.get("state")
    if not isinstance(stored, dict):
        return
    for pid, values in stored.items():
        param = by_id.get(pid)
        if param is None or not isinstance(values, dict):
            continue
        for key, value in values.items():
            if (
                key != "step"
                and isinstance(value, torch.Tensor)
                and tuple(value.shape) == tuple(param.shape)
                and _kind(value.dtype) != _kind(param.dtype)
            ):
                raise CheckpointMismatchError(
                    f"{source}: state {key!r} of parameter {pid} is stored as {value.dtype} but "
                    f"the parameter is {param.dtype}; the file was written for another model or "
                    "was altered. Load a checkpoint saved from this model."
                )


def read_contents(
    storage: Storage,
    folder: str,
    manifest: Manifest,
    objects: TrainingObjects,
    rank: int,
    verify: bool = True,
) -> LoadedContents:
    """Read and check every file this process needs to restore ``objects``; change nothing.

    Raises:
        CorruptCheckpointError: a file missing, truncated, or disagreeing with the manifest.
        CheckpointMismatchError: a count of objects, a model's keys, or an optimizer's groups
            that do not match, naming the file and the fix.
    """
    entries: dict[str, FileEntry] = manifest.file_map()
    expected: Mapping[str, FileEntry] | None = entries if verify else None
    names = list(entries)
    out = LoadedContents()

    _check_count(
        folder,
        "model",
        _indexes(names, "model"),
        list(range(len(objects.models))),
        "Prepare the same models in the same order as when saving (a load pre-hook may remove "
        "models it restores itself).",
    )
    for i, model in enumerate(objects.models):
        target = unwrap_model(model)
        # zero_copy: these tensors only live until they are copied into the model.
        tensors = read_model_files(
            storage, folder, model_stem(i), _only(expected, names), zero_copy=True
        )
        strict = bool(objects.model_load_kwargs.get("strict", True))
        check_model_keys(target, tensors, join(folder, model_file(i)), strict=strict)
        out.models.append((target, tensors))

    groups: list[tuple[str, Sequence[tuple[int, Any]], str]] = [
        ("optimizer", list(enumerate(objects.optimizers)), "Prepare the same optimizers."),
        ("scheduler", list(enumerate(objects.schedulers)), "Prepare the same schedulers."),
        ("dataloader", _stateful_loaders(objects.dataloaders), "Prepare the same dataloaders."),
        (
            "custom",
            list(enumerate(objects.custom)),
            "Call register_for_checkpointing with the same objects, in the same order, as when "
            "saving.",
        ),
    ]
    for kind, items, fix in groups:
        label = "registered object" if kind == "custom" else kind
        _check_count(folder, label, _indexes(names, kind), [i for i, _ in items], fix)
        for i, obj in items:
            stem = object_stem(kind, i)
            # zero_copy: like torch.load(mmap=True); accelkit never rewrites a file in place,
            # so the map stays valid even when retention later deletes the checkpoint.
            state = read_state(storage, folder, stem, _only(expected, names), zero_copy=True)
            if kind == "optimizer":
                _check_optimizer(obj, state, join(folder, stem + STRUCTURE_SUFFIX))
            out.states.append((obj, state, join(folder, stem + STRUCTURE_SUFFIX)))

    if objects.scaler is not None:
        scaler = object_stem("scaler")
        if scaler + STRUCTURE_SUFFIX in entries:
            state = read_state(storage, folder, scaler, _only(expected, names))
            out.states.append((objects.scaler, state, join(folder, scaler + STRUCTURE_SUFFIX)))
        else:
            logger.warning(
                "%s has no grad scaler state; the current scaler keeps its initial scale.", folder
            )
    elif object_stem("scaler") + STRUCTURE_SUFFIX in entries:
        logger.warning(
            "%s holds a grad scaler state but this run has no scaler (mixed_precision differs);"
            " it is not restored.",
            folder,
        )

    rng_stem = random_states_stem(rank)
    if rng_stem + STRUCTURE_SUFFIX in entries:
        out.rng = read_state(storage, folder, rng_stem, _only(expected, names), map_location="cpu")
        out.rng_file = join(folder, rng_stem + STRUCTURE_SUFFIX)
        check_rng_state(out.rng, out.rng_file)  # refused now, before anything is restored
    elif rank >= manifest.world_size:
        out.rng_fallback_seed = fallback_rng_seed(manifest, rank)
    else:
        raise CorruptCheckpointError(
            f"{folder} has no {rng_stem}{STRUCTURE_SUFFIX} for process {rank}, though "
            f"{manifest.world_size} process(es) saved it. Restore the file, or load another "
            "checkpoint."
        )
    fingerprint = resume_fingerprint_stem(rank)
    if fingerprint + STRUCTURE_SUFFIX in entries:
        source = join(folder, fingerprint + STRUCTURE_SUFFIX)
        record = read_state(storage, folder, fingerprint, _only(expected, names))
        out.fingerprint = check_fingerprint(record, source)
    return out


def fallback_rng_seed(manifest: Manifest, rank: int) -> int:
    """The seed of a process that has no saved random states: fixed by checkpoint and rank."""
    return ((manifest.step + 1) * 1_000_003 + (manifest.iteration or 0) * 7919 + rank) % 2**63


def _only(expected: Mapping[str, FileEntry] | None, names: Sequence[str]) -> Any:
    # With verification off, readers still learn which files exist from the manifest (an
    # entry-less mapping would make them probe storage); entries carry no checksum then.
    if expected is not None:
        return expected
    return _Unverified(names)


class _Unverified(dict[str, Any]):
    """Manifest names without checksums: readers know what exists but verify nothing."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__()
        self._names = set(names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __bool__(self) -> bool:
        return True

    def get(self, name: Any, default: Any = None) -> Any:
        return None


class _ParamIds(list[Any]):
    """A parameter group's ``params`` whose ``in`` is a set lookup.

    torch's ``Optimizer.load_state_dict`` asks ``param_id in group["params"]`` for every state
    tensor, which is quadratic in the number of parameters (10,000 parameters: 1.6 s of a
    2.5 s ``load_state``, measured by ``python -m benchmarks --only scaling``).
    """

    def __contains__(self, item: object) -> bool:
        ids = self.__dict__.get("_ids")
        if ids is None or len(ids) != len(self):
            ids = self.__dict__["_ids"] = set(self)
        return item in ids


def _fast_param_lookup(state: Any) -> Any:
    """``state`` with each ``param_groups[i]["params"]`` a :class:`_ParamIds` (torch-style
    optimizer states only; anything else is returned as it is)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return state
    return {**state, "param_groups": [{**g, "params": _ParamIds(g["params"])} for g in groups]}


def apply_contents(loaded: LoadedContents, objects: TrainingObjects) -> None:
    """Restore the objects from what :func:`read_contents` read (models first, RNG last)."""
    for model, tensors in loaded.models:
        model.load_state_dict(tensors, **objects.model_load_kwargs)
    for obj, state, source in loaded.states:
        try:
            obj.load_state_dict(_fast_param_lookup(state))
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointMismatchError(
                f"{source}: {type(obj).__name__}.load_state_dict refused it ({exc}). Restore it "
                "into the same kind of object it was saved from."
            ) from exc
    if loaded.rng is not None:
        restore_rng_state(loaded.rng, loaded.rng_file)
    elif loaded.rng_fallback_seed is not None:
        set_seed(loaded.rng_fallback_seed)
