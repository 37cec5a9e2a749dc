"""Model weights: one safetensors file or Hugging Face-style shards, and loading them back.

Public API:

- :func:`write_model_files(storage, folder, state_dict, stem, max_shard_size) <write_model_files>`
  -- ``<stem>.safetensors``, or ``<stem>-0000i-of-0000N.safetensors`` plus
  ``<stem>.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). Tensors shared
  under several names (tied weights) are stored once and recorded as aliases.
- :func:`read_model_files(storage, folder, stem, expected) <read_model_files>` -- the state
  dict back, verified against manifest entries when given.
- :func:`read_index`, :func:`check_weight_map`, :func:`parse_aliases`, :func:`plan_shards`
  -- the parts those two share with an export (:mod:`~accelkit.checkpointing.interop.hf_export`).
- :func:`check_model_keys(model, tensors, source) <check_model_keys>` -- list missing,
  unexpected and mis-shaped keys in one error.
- :func:`save_model(model, save_directory, max_shard_size="10GB", safe_serialization=True)
  <save_model>` and :func:`load_checkpoint_in_model(model, checkpoint, device_map=None)
  <load_checkpoint_in_model>` -- the documented functions.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import (
    TENSORS_SUFFIX,
    check_relative_path,
    index_name,
    shard_names,
    weights_pattern,
)
from accelkit.checkpointing.formats.safetensors_io import (
    parse_size,
    read_safetensors,
    write_safetensors,
)
from accelkit.checkpointing.storage import Storage, WrittenFile, get_storage, join
from accelkit.checkpointing.storage.base import StorageNotFoundError
from accelkit.checkpointing.storage.confined import confine
from accelkit.checkpointing.storage.verified import read_verified_bytes
from accelkit.errors import ConfigurationError, WrongTypeError

__all__ = [
    "ALIASES_KEY",
    "ModelIndex",
    "check_model_keys",
    "check_weight_map",
    "load_checkpoint_in_model",
    "model_file_names",
    "parse_aliases",
    "plan_shards",
    "read_index",
    "read_model_files",
    "save_model",
    "write_model_files",
]

ALIASES_KEY = "accelkit_aliases"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _corrupt(url: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: {why}. The file is damaged: load another checkpoint, or save the model again."
    )


def _dedupe(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store tensors that are the very same view once; map the others to it (tied weights)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise WrongTypeError(
                f"State dict entry {name!r} is a {type(tensor).__name__}, not a tensor; model "
                "files hold tensors only (put other values in a registered object)."
            )
        key = None
        if tensor.numel() > 0 and tensor.layout == torch.strided:
            key = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        kept[name] = tensor
    return kept, aliases


def plan_shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Split the names of ``tensors``, in order, into shards of at most ``limit`` bytes each (a
    larger tensor gets a shard of its own). Only sizes are used: meta tensors will do."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = _nbytes(tensor)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def model_file_names(stem: str, count: int, suffix: str = TENSORS_SUFFIX) -> list[str]:
    """File names of a model saved under ``stem`` in ``count`` shards (see
    :func:`~accelkit.checkpointing.formats.layout.shard_names`)."""
    return shard_names(stem, count, suffix)


def _write_pickled(storage: Storage, url: str, tensors: Mapping[str, torch.Tensor]) -> WrittenFile:
    # Only on request (save_model(safe_serialization=False)); read back with weights_only=True.
    buffer = io.BytesIO()
    torch.save(dict(tensors), buffer)
    return storage.write_bytes(url, buffer.getbuffer())


def _read_weights_file(
    storage: Storage, url: str, expected: Any, zero_copy: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not url.endswith(".bin"):
        return read_safetensors(storage, url, expected, zero_copy)
    data = read_verified_bytes(storage, url, expected)
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{url}: refused by torch.load(weights_only=True) ({exc}); accelkit never unpickles "
            "arbitrary objects. Re-save the weights as safetensors."
        ) from None
    if not isinstance(tensors, dict) or not all(
        isinstance(v, torch.Tensor) for v in tensors.values()
    ):
        raise _corrupt(url, "does not hold a dict of tensors")
    return tensors, {}


def write_model_files(
    storage: Storage,
    folder: str,
    state_dict: Mapping[str, torch.Tensor],
    stem: str = "model",
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> dict[str, WrittenFile]:
    """Write one model's state dict under ``folder``; returns relative name -> written file.

    One ``<stem>.safetensors`` if it fits in ``max_shard_size``, else
    ``<stem>-0000i-of-0000N.safetensors`` plus ``<stem>.safetensors.index.json`` (Hugging Face
    format: ``metadata.total_size`` and ``weight_map``). Tensors shared under several names
    (tied weights) are stored once; the other names are recorded as aliases. With
    ``safe_serialization=False`` the files are ``torch.save`` pickles ending in ``.bin``.
    """
    limit = parse_size(max_shard_size)
    kept, aliases = _dedupe(state_dict)
    shards = plan_shards(kept, limit)
    suffix = ".safetensors" if safe_serialization else ".bin"
    names = model_file_names(stem, len(shards), suffix)
    metadata = {"format": "pt"}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    written: dict[str, WrittenFile] = {}
    for file_name, members in zip(names, shards):
        url = join(folder, file_name)
        if not safe_serialization:
            # torch.save keeps tied tensors tied within one file by itself.
            part = dict(state_dict) if len(shards) == 1 else {n: kept[n] for n in members}
            written[file_name] = _write_pickled(storage, url, part)
            continue
        written[file_name] = write_safetensors(
            storage, url, {n: kept[n] for n in members}, metadata
        )
    if len(shards) > 1:
        index_meta: dict[str, Any] = {"total_size": sum(_nbytes(t) for t in kept.values())}
        if aliases:
            index_meta[ALIASES_KEY] = aliases
        index = {
            "metadata": index_meta,
            "weight_map": {n: f for f, members in zip(names, shards) for n in members},
        }
        data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        index_file = index_name(stem, suffix)
        written[index_file] = storage.write_bytes(join(folder, index_file), data)
    return written


def parse_aliases(value: Any, url: str) -> dict[str, str]:
    """The ``accelkit_aliases`` metadata (alias -> stored name) of a file or an index, checked.

    Raises:
        CorruptCheckpointError: naming ``url``, when it is not a string map.
    """
    if isinstance(value, str):
        value = load_json(value, f"{url} ({ALIASES_KEY} metadata)", max_depth=1)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _corrupt(url, f"invalid {ALIASES_KEY} metadata")
    return value


def _resolve_aliases(
    tensors: dict[str, torch.Tensor], aliases: Mapping[str, str], url: str
) -> None:
    for alias, source in aliases.items():
        if source not in tensors:
            raise _corrupt(url, f"alias {alias!r} points to {source!r}, which is not stored")
        tensors[alias] = tensors[source]


def read_model_files(
    storage: Storage,
    folder: str,
    stem: str = "model",
    expected: Mapping[str, Any] | None = None,
    zero_copy: bool = False,
) -> dict[str, torch.Tensor]:
    """Read a model saved by :func:`write_model_files` (single file or sharded).

    Args:
        storage: its storage.
        folder: the folder holding the files.
        stem: ``model``, ``model_1``...
        expected: manifest entries by relative name, to verify sizes and checksums.
        zero_copy: see :func:`~accelkit.checkpointing.formats.safetensors_io.read_safetensors`.

    Raises:
        CorruptCheckpointError: for a missing shard, an unsafe index, or a damaged file.
    """
    expected = expected or {}
    index = index_name(stem)
    single = stem + TENSORS_SUFFIX
    if expected:
        use_index = index in expected
    else:
        use_index = not storage.exists(join(folder, single)) and storage.exists(join(folder, index))
    if use_index:
        return _read_index(storage, folder, index, expected, zero_copy)
    tensors, meta = read_safetensors(storage, join(folder, single), expected.get(single), zero_copy)
    url = join(folder, single)
    _resolve_aliases(tensors, parse_aliases(meta.get(ALIASES_KEY, "{}"), url), url)
    return tensors


@dataclass(frozen=True)
class ModelIndex:
    """A ``*.safetensors.index.json``, checked: where each tensor is, and the aliases.

    Attributes:
        url: the index.
        files: its shard files, relative to its folder, in the order first named.
        weight_map: tensor name -> shard file.
        aliases: tied names -> the stored name (accelkit's own metadata; empty otherwise).
    """

    url: str
    files: list[str]
    weight_map: dict[str, str]
    aliases: dict[str, str]


def read_index(
    storage: Storage, folder: str, index_name: str, expected: Mapping[str, Any]
) -> ModelIndex:
    """Read and check the index ``folder/index_name`` (verified against its manifest entry in
    ``expected``, if any): every shard a relative path inside ``folder``, reached through no
    symbolic link, and present.

    Raises:
        CorruptCheckpointError: naming the index and the bad field or shard.
    """
    url = join(folder, index_name)
    raw = read_verified_bytes(storage, url, expected.get(index_name))
    index = load_json(raw, url)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _corrupt(url, "not a valid index (expected a JSON object with a weight_map)")
    meta = index.get("metadata") or {}
    if not isinstance(meta, dict):
        raise _corrupt(url, "the index's metadata is not an object")
    aliases = parse_aliases(meta.get(ALIASES_KEY) or {}, url)
    files: list[str] = []
    for file_name in weight_map.values():
        try:
            check_relative_path(file_name, what=f"shard file name in {url}")
        except ValueError as exc:
            raise CorruptCheckpointError(f"{exc} Refusing to read outside {folder}.") from None
        if storage.links_out(folder, file_name):
            raise CorruptCheckpointError(
                f"Shard {file_name} listed in {url} goes through a symbolic link; refusing to "
                f"read outside {folder}. Replace the link by the file."
            )
        if file_name not in files:
            files.append(file_name)
    for file_name in files:
        if not storage.exists(join(folder, file_name)):
            raise CorruptCheckpointError(
                f"Shard {file_name} listed in {url} is missing. Restore it (all shards of one "
                "save belong together), or load another checkpoint."
            )
    return ModelIndex(url, files, dict(weight_map), aliases)


def check_weight_map(index: ModelIndex, names: Iterable[str]) -> None:
    """Refuse an index whose ``weight_map`` names a tensor its shards (``names``) lack.

    Raises:
        CorruptCheckpointError: naming the index and up to five missing tensors.
    """
    stored = set(names)
    missing = [n for n in index.weight_map if n not in stored]
    if missing:
        raise _corrupt(
            index.url, f"tensors {missing[:5]} are in the weight_map but not in their shard"
        )


def _read_index(
    storage: Storage,
    folder: str,
    index_name: str,
    expected: Mapping[str, Any],
    zero_copy: bool = False,
) -> dict[str, torch.Tensor]:
    index = read_index(storage, folder, index_name, expected)
    tensors: dict[str, torch.Tensor] = {}
    for file_name in index.files:
        shard_url = join(folder, file_name)
        part, _ = _read_weights_file(storage, shard_url, expected.get(file_name), zero_copy)
        tensors.update(part)
    check_weight_map(index, tensors)
    _resolve_aliases(tensors, index.aliases, index.url)
    return tensors


# ------------------------------------------------------------------ the documented API


def save_model(
    model: torch.nn.Module,
    save_directory: str,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Save ``model``'s weights so :func:`load_checkpoint_in_model` (or Hugging Face) reads them.

    Writes ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards plus
    ``model.safetensors.index.json``. Unlike the reference, weight files of an earlier save
    in the folder that this save does not use (old shards, an old index, ``pytorch_model*.bin``)
    are removed, so no loader can pick stale weights.

    Args:
        model: the (unwrapped) model.
        save_directory: a local folder or fsspec URL.
        max_shard_size: largest shard, as bytes or a string like ``"10GB"``.
        safe_serialization: write safetensors (default). ``False`` writes the reference's
            ``pytorch_model.bin`` pickles; accelkit reads them back only with
            ``torch.load(weights_only=True)``.
        storage_options: fsspec options for a URL.

    Returns:
        The names of the files written.
    """
    storage = get_storage(save_directory, storage_options)
    storage.makedirs(save_directory)
    stem = "model" if safe_serialization else "pytorch_model"
    written = write_model_files(
        storage, save_directory, model.state_dict(), stem, max_shard_size, safe_serialization
    )
    earlier = (weights_pattern("model", TENSORS_SUFFIX), weights_pattern("pytorch_model", ".bin"))
    stale = re.compile(f"^(?:{'|'.join(earlier)})$")
    for entry in storage.listdir(save_directory):
        if not entry.is_dir and stale.match(entry.name) and entry.name not in written:
            storage.remove(join(save_directory, entry.name))
    return sorted(written)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def check_model_keys(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    strict: bool = True,
    exact_dtype: bool = True,
) -> None:
    """Raise :class:`CheckpointMismatchError` listing missing/unexpected keys, and stored
    tensors whose shape or dtype disagrees with the model's.

    Args:
        model: the model the tensors are for.
        tensors: the stored tensors by key.
        source: the file, for the message.
        strict: also refuse missing and unexpected keys (shapes and dtypes are always checked).
        exact_dtype: a stored dtype must equal the model's (resuming); with ``False`` only its
            kind must (float, int, bool, complex: loading float32 weights into a bfloat16 model
            casts them, but integer bytes are never read as floats or the reverse).
    """
    own = model.state_dict()
    missing = [k for k in own if k not in tensors] if strict else []
    unexpected = sorted(k for k in tensors if k not in own) if strict else []
    shapes = [
        f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape)
    ]
    dtypes = [
        f"{k}: checkpoint {tensors[k].dtype} vs model {own[k].dtype}"
        for k in own
        if k in tensors
        and (
            tensors[k].dtype != own[k].dtype
            if exact_dtype
            else _kind(tensors[k].dtype) != _kind(own[k].dtype)
        )
    ]
    if missing or unexpected or shapes or dtypes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if shapes:
            parts.append(f"shape mismatches {shapes}")
        if dtypes:
            parts.append(f"dtype mismatches {dtypes}")
        fix = (
            "Load it into the same architecture and dtype it was saved from"
            if dtypes and not (missing or unexpected or shapes)
            else "Load it into the same architecture it was saved from"
        )
        if missing or unexpected:
            fix += (
                " (or pass strict=False to load_checkpoint_in_model to load the matching keys only)"
            )
        raise CheckpointMismatchError(
            f"{source} does not fit {type(model).__name__}: {'; '.join(parts)}. {fix}."
        )


def _refuse_out_of_scope(**options: tuple[Any, Any]) -> None:
    for name, (value, allowed) in options.items():
        if value != allowed:
            raise ConfigurationError(
                f"load_checkpoint_in_model({name}={value!r}) is not supported: big-model "
                "inference (offloading, 8-bit loading, rank-0 broadcast, sharded state) is out of "
                f"accelkit's scope. Leave {name}={allowed!r}; sharded (FSDP) state is restored "
                "by accelerator.load_state."
            )


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ConfigurationError(f"dtype={dtype!r} is not a torch dtype; pass e.g. torch.bfloat16.")
    return value


def _convert_floats(model: torch.nn.Module, dtype: torch.dtype, keep_fp32: list[str]) -> None:
    """Put the model's floating-point parameters and buffers in ``dtype`` (``float32`` under
    the modules named in ``keep_fp32``), as the reference does before loading with ``dtype``."""
    for name, module in model.named_modules():
        parts = name.split(".")
        kept = any(k in parts or name == k or name.startswith(k + ".") for k in keep_fp32)
        target = torch.float32 if kept else dtype
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != target:
                    tensor.data = tensor.data.to(target)


def _sole_index(storage: Storage, folder: str) -> str:
    """The folder's one ``*.index.json`` (any stem, as the reference accepts), or an error."""
    indexes = [
        entry.name
        for entry in storage.listdir(folder)
        if not entry.is_dir and entry.name.endswith(".index.json")
    ]
    if len(indexes) == 1:
        return indexes[0]
    if not indexes:
        raise StorageNotFoundError(
            f"No model.safetensors(.index.json), pytorch_model.bin(.index.json) or other "
            f"*.index.json in {folder!r}; pass the weights file or index itself."
        )
    raise ConfigurationError(
        f"{folder!r} holds several indexes ({', '.join(indexes)}); pass the one to load, "
        f"e.g. load_checkpoint_in_model(model, {join(folder, indexes[0])!r})."
    )


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str,
    device_map: Any = None,
    offload_folder: str | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = True,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Load weights from a safetensors file, a folder, or a ``*.index.json`` into ``model``.

    The parameters are Accelerate's, in its order. Unlike the reference, ``strict`` defaults
    to ``True``: the reference silently keeps random weights for keys the checkpoint lacks.

    Args:
        model: the model to fill.
        checkpoint: a ``.safetensors`` (or ``.bin``) file, an index file (``.json``), or a
            folder holding ``model.safetensors``, ``pytorch_model.bin``, their index, or one
            other ``*.index.json``; local or fsspec URL. Where a folder holds both
            ``model.safetensors`` and ``pytorch_model.bin``, the safetensors file is read (the
            reference reads the pickle).
        device_map: ``None`` (keep each parameter's device), a device, or a mapping of module
            name prefixes to devices (``{"": "cuda:0"}``); modules are moved there first.
        offload_folder: offloading to disk is out of scope; must be ``None``.
        dtype: convert the model's floating-point parameters and buffers to this dtype (a
            ``torch.dtype`` or its name, ``"bfloat16"``) before loading into them.
        offload_state_dict: out of scope; must be ``False``.
        offload_buffers: out of scope; must be ``False``.
        keep_in_fp32_modules: with ``dtype``, modules kept in ``float32``: a name matches a
            module whose dotted path has it as a component (``"lm_head"``) or prefix.
        offload_8bit_bnb: out of scope; must be ``False``.
        strict: refuse missing or unexpected keys.
        full_state_dict: the checkpoint holds full tensors (the only kind this loads); must be
            ``True`` (sharded state is loaded by ``load_state``).
        broadcast_from_rank0: out of scope (every process reads the file); must be ``False``.
        storage_options: fsspec options for a URL.

    Raises:
        CorruptCheckpointError: for missing shards, an index whose file names leave its
            folder, or damaged files.
        CheckpointMismatchError: for keys or shapes that do not match (with ``strict``), or a
            stored tensor whose kind (float, int, bool) differs from the model's.
        ValueError: for an out-of-scope option (offloading, 8-bit, broadcasting), a bad
            ``dtype``, or a folder holding several indexes and no known weights name.
        FileNotFoundError: ``checkpoint`` does not exist, or is a folder without weights.
    """
    _refuse_out_of_scope(
        offload_folder=(offload_folder, None),
        offload_state_dict=(offload_state_dict, False),
        offload_buffers=(offload_buffers, False),
        offload_8bit_bnb=(offload_8bit_bnb, False),
        full_state_dict=(full_state_dict, True),
        broadcast_from_rank0=(broadcast_from_rank0, False),
    )
    if dtype is not None:
        _convert_floats(model, _as_dtype(dtype), keep_in_fp32_modules or [])
    storage = get_storage(checkpoint, storage_options)
    if storage.isdir(checkpoint):
        storage = confine(storage, checkpoint)  # no link inside the folder is followed
        folder, name = checkpoint, None
        for candidate in (
            index_name("model"),
            "model" + TENSORS_SUFFIX,
            index_name("pytorch_model", ".bin"),
            "pytorch_model.bin",
        ):
            if storage.exists(join(checkpoint, candidate)):
                name = candidate
                break
        if name is None:
            name = _sole_index(storage, checkpoint)
    else:
        if not storage.exists(checkpoint):
            raise StorageNotFoundError(f"No checkpoint at {checkpoint!r}.")
        folder, _, name = checkpoint.rstrip("/").rpartition("/")
        folder = folder or "."
        storage = confine(storage, folder)
    if name.endswith(".json"):  # the reference reads any .json file given as an index
        tensors = _read_index(storage, folder, name, {}, zero_copy=True)
    else:
        url = join(folder, name)
        tensors, meta = _read_weights_file(storage, url, None, zero_copy=True)
        _resolve_aliases(tensors, parse_aliases(meta.get(ALIASES_KEY, "{}"), url), url)
    check_model_keys(model, tensors, join(folder, name), strict=strict, exact_dtype=False)
    if not strict:
        own = model.state_dict()
        tensors = {k: v for k, v in tensors.items() if k in own}
    if device_map is not None:
        if isinstance(device_map, Mapping):
            for prefix in sorted(device_map, key=len):
                value = device_map[prefix]
                if value in ("disk", "meta"):
                    raise ConfigurationError(
                        f"device_map[{prefix!r}]={value!r}: offloading is not supported; map "
                        "every module to a device."
                    )
                (model.get_submodule(prefix) if prefix else model).to(torch.device(value))
        else:
            model.to(torch.device(device_map))
    model.load_state_dict(tensors, strict=strict)
