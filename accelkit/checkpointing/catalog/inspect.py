"""Look inside safetensors files without loading a tensor: names, dtypes, shapes, offsets.

A safetensors file starts with an 8-byte little-endian header length ``N``, then ``N`` bytes of
JSON (``{"<tensor>": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the tensor data. Only those first ``8 + N`` bytes are read here, through
:mod:`~accelkit.checkpointing.storage`, so this works the same on a local disk, S3 or memory.

Public API:

- :class:`TensorInfo` -- ``name``, ``dtype``, ``shape``, ``file``, ``data_offsets``,
  ``numel``, ``nbytes``.
- :class:`SafetensorsHeader` -- one file's tensors and ``__metadata__``.
- :func:`read_safetensors_header(storage, url) <read_safetensors_header>` -- parse and check
  one file's header (refuses a header larger than :data:`MAX_HEADER_BYTES` or than the file).
- :func:`safetensors_files(storage, path) <safetensors_files>` -- the safetensors files of a
  checkpoint (from its manifest), a ``save_model`` folder, an index JSON or a single file.
- :func:`state_tensor_names(storage, url) <state_tensor_names>` -- for the tensors file of an
  object state (``optimizer.safetensors``...), where each tensor sits in the state
  (``optimizer/state/0.weight/exp_avg``), read from its structure file (``optimizer.json``).
"""

from __future__ import annotations

import json
from typing import Any

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import (
    MANIFEST_NAME,
    STRUCTURE_SUFFIX,
    check_relative_path,
)
from accelkit.checkpointing.formats.manifest import read_manifest
from accelkit.checkpointing.formats.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorInfo,
    read_header,
)
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.base import StorageNotFoundError

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "read_safetensors_header",
    "safetensors_files",
    "key_text",
    "name_state_tensors",
    "named_path",
    "parameter_names",
    "state_tensor_names",
]

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


def read_safetensors_header(
    storage: Storage, url: str, file: str | None = None, max_header_bytes: int = MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Read and check the header of the safetensors file at ``url``; no tensor is loaded.

    Args:
        storage: the storage of ``url``.
        url: the file.
        file: how to name it in the result (defaults to its base name).
        max_header_bytes: refuse a header longer than this.

    Returns:
        The parsed header (see
        :func:`~accelkit.checkpointing.formats.safetensors_header.parse_header` for what is
        checked).

    Raises:
        CorruptCheckpointError: a truncated file, an absurd header length, bad JSON or an
            entry that does not describe a tensor; the message names the file and the field.
        FileNotFoundError: if there is no file at ``url``.
        PermissionError: if it is a local symbolic link (never followed).
    """
    with storage.open_read(url) as f:  # first, so a local symlink is refused before a stat
        return read_header(f, url, storage.size(url), file, max_header_bytes)


def _index_files(storage: Storage, index_url: str) -> list[str]:
    index = load_json(storage.read_bytes(index_url), index_url)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(
            f"{index_url}: no 'weight_map' object; expected a Hugging Face safetensors index. "
            "Save the model again to rewrite it."
        )
    names = set()
    for value in weight_map.values():
        try:
            names.add(check_relative_path(value, what=f"file name in {index_url}"))
        except ValueError as exc:
            raise CorruptCheckpointError(str(exc)) from None
    return sorted(names)


def safetensors_files(storage: Storage, path: str) -> list[tuple[str, str]]:
    """The safetensors files to inspect at ``path``, as ``(name, url)`` pairs.

    - a ``.safetensors`` file: that file (named by its base name);
    - a ``*.safetensors.index.json``: the shards its ``weight_map`` names, beside it;
    - a checkpoint folder with a manifest: the ``.safetensors`` files the manifest lists;
    - any other folder (a ``save_model`` output): every ``.safetensors`` file under it.

    Names are relative to the folder; only files inside it are ever returned.

    Raises:
        FileNotFoundError: if nothing exists at ``path``.
        CorruptCheckpointError: for an unreadable manifest or index.
    """
    path = path.rstrip("/") or path
    if storage.isfile(path):
        name = path.rsplit("/", 1)[-1]
        if not path.endswith(INDEX_SUFFIX):
            return [(name, path)]
        folder = path[: len(path) - len(name)]
        return [(n, folder + n) for n in _index_files(storage, path)]
    if not storage.isdir(path):
        raise StorageNotFoundError(path)
    names: list[str] | None = None
    if storage.exists(join(path, MANIFEST_NAME)):
        try:
            manifest = read_manifest(storage, path)
        except ValueError as exc:
            raise CorruptCheckpointError(str(exc)) from None
        if manifest is not None:
            names = [e.path for e in manifest.files]
    if names is None:
        names = list(storage.walk_files(path))
    return [(n, join(path, n)) for n in sorted(names) if n.endswith(SAFETENSORS_SUFFIX)]


_STATE_FORMAT = "accelkit-state"  # the format tag of state_io's structure files
_TENSOR_TAGS = ("__tensor__", "__ndarray__")


def key_text(key: Any) -> str:
    """A key of a saved mapping as one path component (a string as is, anything else as
    compact JSON)."""
    if isinstance(key, str):
        return key
    if isinstance(key, (int, float, bool)) or key is None:
        return json.dumps(key)
    return json.dumps(key, separators=(",", ":"), sort_keys=True)


def _walk(node: Any, path: tuple[str, ...], found: dict[str, list[tuple[str, ...]]]) -> None:
    """Record the path of every tensor reference under ``node`` (depth bounded by load_json)."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            _walk(item, (*path, str(index)), found)
        return
    if not isinstance(node, dict):
        return
    if len(node) == 1:
        ((tag, value),) = node.items()
        if tag in _TENSOR_TAGS and isinstance(value, str):
            found.setdefault(value, []).append(path)
            return
        if tag == "__dict__" and isinstance(value, list):
            for pair in value:
                if isinstance(pair, list) and len(pair) == 2:
                    _walk(pair[1], (*path, key_text(pair[0])), found)
            return
        if tag in ("__tuple__", "__set__"):
            _walk(value, path, found)
            return
    for key, value in node.items():
        _walk(value, (*path, key), found)


def parameter_names(state: Any) -> dict[str, str]:
    """Optimizer parameter id -> name, where the param groups carry ``param_names``.

    torch stores ``param_names`` beside ``params`` when the optimizer was built from
    ``model.named_parameters()``; otherwise only the ids are saved (positions in the order
    the parameters were given to the optimizer), and the ids are shown as they are.
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    names: dict[str, str] = {}
    for group in groups if isinstance(groups, list) else []:
        if not isinstance(group, dict):
            continue
        ids, labels = group.get("params"), group.get("param_names")
        if isinstance(ids, list) and isinstance(labels, list) and len(ids) == len(labels):
            for pid, label in zip(ids, labels, strict=True):
                if isinstance(label, str) and isinstance(pid, (int, str)):
                    names[key_text(pid)] = label
    return names


def state_tensor_names(storage: Storage, tensors_url: str) -> dict[str, str]:
    """Where each tensor of an object state's tensors file sits in the state.

    accelkit stores an object state ``X`` (an optimizer, scheduler, random states...) as
    ``X.json`` (the structure, each tensor a reference such as ``{"__tensor__": "t1"}``) and
    ``X.safetensors`` (the tensors, under the keys ``t0``, ``t1``...). This reads ``X.json``
    beside ``tensors_url`` and names each key by its path in the structure, joined with ``/``
    (parameter names contain dots) and starting with ``X``: ``optimizer/state/3/exp_avg``.
    In an optimizer's ``state``, the parameter id (``3``) is replaced by the parameter's name
    (``optimizer/state/0.weight/exp_avg``) where the saved param groups name their
    parameters (an optimizer built from ``model.named_parameters()``).

    A tensor referenced from several places (stored once) gets its paths joined by ``, ``.

    Args:
        storage: the storage of ``tensors_url`` (confined by the caller).
        tensors_url: a ``.safetensors`` file.

    Returns:
        Tensor key -> path; empty when there is no ``X.json`` beside the file or it is not an
        accelkit state file (a model's weights, a ``save_model`` folder).

    Raises:
        CorruptCheckpointError: ``X.json`` is not a regular file, is not valid JSON or nests
            too deeply.
    """
    if not tensors_url.endswith(SAFETENSORS_SUFFIX):
        return {}
    structure_url = tensors_url[: -len(SAFETENSORS_SUFFIX)] + STRUCTURE_SUFFIX
    if not storage.isfile(structure_url):
        if storage.exists(structure_url):  # a folder or a named pipe (reading one would block)
            raise CorruptCheckpointError(
                f"{structure_url}: not a regular file; accelkit writes a JSON file there. The "
                "checkpoint is damaged or crafted: `accelkit ckpt verify` checks it."
            )
        return {}
    document = load_json(storage.read_bytes(structure_url), structure_url)
    if not isinstance(document, dict) or document.get("format") != _STATE_FORMAT:
        return {}
    stem = tensors_url.rsplit("/", 1)[-1][: -len(SAFETENSORS_SUFFIX)]
    return name_state_tensors(document.get("state"), stem)


def name_state_tensors(state: Any, stem: str) -> dict[str, str]:
    """Tensor key -> its place in ``state`` (the ``"state"`` tree of a structure file), as
    :func:`state_tensor_names` names it: ``<stem>/<path>``, an optimizer's parameter ids
    replaced by their names where the param groups carry them."""
    found: dict[str, list[tuple[str, ...]]] = {}
    _walk(state, (), found)
    names = parameter_names(state)
    return {
        key: ", ".join("/".join((stem, *named_path(path, names))) for path in paths)
        for key, paths in found.items()
    }


def named_path(path: tuple[str, ...], names: dict[str, str]) -> tuple[str, ...]:
    """``path`` in an optimizer's state with the parameter id (``state/3/...``) replaced by
    the parameter's name from ``names`` (:func:`parameter_names`), where it has one."""
    if len(path) >= 2 and path[0] == "state" and path[1] in names:
        return (path[0], names[path[1]], *path[2:])
    return path
